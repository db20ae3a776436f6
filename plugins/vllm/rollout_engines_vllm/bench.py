"""The vLLM backend's part of the benchmarks (imported only by :mod:`rollout_engines.bench`).

``rollout-engines bench generate --backend vllm`` (:func:`generate_baseline`, registered as the
backend's ``generate_baseline``): generation overhead of :class:`VllmEngine` over raw vLLM,
measured in one run. One engine is started; the same batch (token-id prompts, greedy,
``ignore_eos`` so every prompt yields exactly ``max_tokens`` tokens) goes alternately through its
``AsyncLLM`` directly and through ``VllmEngine.generate``. Rounds alternate so load from other
processes hits both alike; the best round of each is compared (the machine can only slow a run
down, never speed it up).

``python -m rollout_engines_vllm.bench {generate,push} ...`` is ``rollout-engines bench
{generate,push} --backend vllm ...``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_engines.bench.generate import GenerateArgs


def generate_baseline(args: GenerateArgs) -> dict[str, Any]:
    from rollout_engines.factory import create_engine

    from .engine import VllmEngine

    model = args.model_path()
    batch, max_tokens, rounds = args.prompts, args.max_tokens, args.repeats
    engine = create_engine("vllm", model=model, **args.options)
    assert isinstance(engine, VllmEngine)
    try:
        request = args.batch(vocab=int(engine.tokenizer.vocab_size))
        prompts = request.prompt_token_ids or []
        llm = engine.async_llm
        vparams = engine.vllm_sampling_params(request.sampling)

        async def direct() -> tuple[int, float]:
            start = time.perf_counter()

            async def one(i: int) -> int:
                final: Any = None
                async for out in llm.generate({"prompt_token_ids": prompts[i]}, vparams, f"direct-{time.time_ns()}-{i}"):
                    final = out
                return sum(len(o.token_ids) for o in final.outputs)

            tokens = sum(await asyncio.gather(*(one(i) for i in range(batch))))
            return tokens, time.perf_counter() - start

        async def through_engine() -> tuple[int, float]:
            start = time.perf_counter()
            outs = await engine.generate(request)
            return sum(len(c.token_ids) for c in outs), time.perf_counter() - start

        async def main() -> dict[str, list[float]]:
            await through_engine()  # warm-up (first batch pays one-time costs)
            engine.run_on_engine_loop(direct)
            rates: dict[str, list[float]] = {"direct": [], "engine": []}
            tokens = {"direct": 0, "engine": 0}
            for r in range(rounds):
                order = ("direct", "engine") if r % 2 == 0 else ("engine", "direct")
                for name in order:
                    # raw vLLM runs on the engine's own loop, as a direct user's code would
                    n, secs = engine.run_on_engine_loop(direct) if name == "direct" else await through_engine()
                    tokens[name] = n
                    rates[name].append(n / secs)
            if tokens["direct"] != tokens["engine"]:
                raise RuntimeError(f"token counts differ: {tokens}")
            return rates

        rates = asyncio.run(main())
    finally:
        asyncio.run(engine.close())
    best_engine, best_direct = max(rates["engine"]), max(rates["direct"])
    return {
        "backend": "vllm",
        "model": str(model),
        "platform": engine.platform,
        "prompts": batch,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "tokens_per_s": round(best_engine, 1),
        "direct_tokens_per_s": round(best_direct, 1),
        "ratio": round(best_engine / best_direct, 4),
        "median_tokens_per_s": round(statistics.median(rates["engine"]), 1),
        "median_direct_tokens_per_s": round(statistics.median(rates["direct"]), 1),
        "median_ratio": round(statistics.median(rates["engine"]) / statistics.median(rates["direct"]), 4),
        "stat": f"best of {rounds} alternating rounds",
        "rounds_tokens_per_s": [round(x) for x in rates["engine"]],
        "rounds_direct_tokens_per_s": [round(x) for x in rates["direct"]],
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout_engines_vllm.bench {generate,push} [--json] ...``: the core's benchmark
    with ``--backend vllm``."""
    from rollout_engines.cli import main as cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("generate", "push"):
        print("usage: python -m rollout_engines_vllm.bench {generate,push} [--json] ...", file=sys.stderr)
        return 2
    return cli_main(["bench", argv[0], "--backend", "vllm", *argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
