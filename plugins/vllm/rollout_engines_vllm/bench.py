"""Generation overhead of :class:`VllmEngine` over raw vLLM, measured in one run.

One engine is started; the same batch (token-id prompts, greedy, ``ignore_eos`` so every prompt
yields exactly ``max_tokens`` tokens) goes alternately through its ``AsyncLLM`` directly and
through ``VllmEngine.generate``. Rounds alternate so load from other processes hits both alike;
the best round of each is compared (the machine can only slow a run down, never speed it up).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from typing import Any

from rollout_engines.bench.push import arg as _get
from rollout_engines.bench.push import parse_options as _options


def run_generate_benchmark(engine_cls: Any, args: Any) -> dict[str, Any]:
    from rollout_engines.factory import create_engine
    from rollout_engines.types import GenerateRequest, SamplingParams

    model = _get(args, "model", None)
    if model is None:
        from rollout_engines.testing.tiny_model import tiny_model_path

        model = str(tiny_model_path())
    batch = int(_get(args, "prompts", 64))
    max_tokens = int(_get(args, "max_tokens", 64))
    rounds = int(_get(args, "repeats", 3))
    prompt_len = int(_get(args, "prompt_len", 32))
    options = _options(args)

    engine = create_engine("vllm", model=str(model), **options)
    assert isinstance(engine, engine_cls)
    try:
        vocab = int(engine._tokenizer.vocab_size)
        rng = random.Random(0)
        prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request = GenerateRequest(prompt_token_ids=prompts, sampling=sampling)
        llm = engine._llm
        vparams = engine._vllm_sampling(sampling, None)

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
            engine._sync(direct)
            rates: dict[str, list[float]] = {"direct": [], "engine": []}
            tokens = {"direct": 0, "engine": 0}
            for r in range(rounds):
                order = ("direct", "engine") if r % 2 == 0 else ("engine", "direct")
                for name in order:
                    # raw vLLM runs on the engine's own loop, as a direct user's code would
                    n, secs = engine._sync(direct) if name == "direct" else await through_engine()
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


def run_push_benchmark(args: Any) -> dict[str, Any]:
    """Weight pushes into a running vLLM engine (``rollout-engines bench push --backend vllm``; see
    :mod:`rollout_engines.bench.push`). On CUDA the first push also learns the copy plan."""
    from rollout_engines.bench.push import run

    if isinstance(args, dict):
        args = {**args, "backend": "vllm"}
    else:
        args.backend = "vllm"
    return run(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout_engines_vllm.bench {generate,push} [--json] ...``"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rollout_engines_vllm.bench")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("generate")
    p.add_argument("--model", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--option", action="append", default=[], metavar="K=V", help="engine option")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("push")
    p.add_argument("--json", action="store_true")
    from rollout_engines.bench.push import add_arguments

    add_arguments(p)
    args = parser.parse_args(argv)
    if args.what == "generate":
        from .engine import VllmEngine

        result = run_generate_benchmark(VllmEngine, args)
    else:
        result = run_push_benchmark(args)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
