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


def _get(args: Any, name: str, default: Any) -> Any:
    value = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
    return default if value is None else value


def _options(args: Any) -> dict[str, Any]:
    """``--option K=V`` pairs (values parsed as JSON where they parse) plus an ``options`` dict."""
    out: dict[str, Any] = dict(_get(args, "options", {}))
    for item in _get(args, "option", []):
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


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
                final = None
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
    """Weight pushes into a running vLLM engine: seconds per push and GB/s, end to end.

    The first push also learns the copy plan (CUDA); later pushes alternate perturbed and original
    weights. Correctness is checked on the way: on CUDA the workers' parameter checksums after
    pushing the original weights equal those at start-up and differ after a perturbed push; on CPU
    the greedy tokens do.
    """
    import torch
    from rollout_engines.factory import create_engine
    from rollout_engines.types import GenerateRequest, SamplingParams
    from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
    from rollout_engines.weights.session import connect_weight_sync

    model = _get(args, "model", None)
    if model is None:
        from rollout_engines.testing.tiny_model import tiny_model_path

        model = str(tiny_model_path())
    pushes = max(1, int(_get(args, "pushes", 5)))
    bucket_bytes = int(float(_get(args, "bucket_mb", 512)) * 2**20)
    options = _options(args)
    transport_options = {k.removeprefix("transport."): v for k, v in options.items() if k.startswith("transport.")}
    options = {k: v for k, v in options.items() if not k.startswith("transport.")}
    engine = create_engine("vllm", model=str(model), **options)
    try:
        cuda = engine.platform == "cuda"
        transport = _get(args, "transport", None) or ("cuda_ipc" if cuda else "shm")
        dtype = engine._llm.model_config.dtype  # a push carries the engine's dtype
        device = "cuda" if transport in ("cuda_ipc", "nccl") else "cpu"
        original = {k: v.to(device) for k, v in load_checkpoint(str(model), dtype=dtype).items()}
        changed = {k: v.to(device) for k, v in perturbed(load_checkpoint(str(model), dtype=dtype)).items()}
        total_bytes = sum(t.numel() * t.element_size() for t in original.values())
        request = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=SamplingParams(temperature=0, max_tokens=8))

        def fingerprint() -> Any:
            if cuda:
                return engine._sync(lambda: engine._llm.collective_rpc("roe_param_checksum"))
            return [c.token_ids for c in asyncio.run(engine.generate(request))]

        start_print = fingerprint()

        async def go() -> tuple[list[float], bool, bool]:
            sync = await connect_weight_sync([engine], transport, bucket_bytes=bucket_bytes, timeout_s=600,
                                             checksum=_get(args, "checksum", "sum64"), options=transport_options)
            times: list[float] = []
            try:
                for i in range(pushes):
                    tensors = changed if i % 2 == 0 else original
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    await sync.push(tensors, version=engine.weight_version + 1)
                    times.append(time.perf_counter() - t0)
                    phases.append(_phases(engine, times[-1]))
                    if i == 0:
                        differs = await asyncio.to_thread(fingerprint) != start_print
                await sync.push(original, version=engine.weight_version + 1)
                same = await asyncio.to_thread(fingerprint) == start_print
            finally:
                await sync.close()
            return times, differs, same

        phases: list[dict[str, float]] = []
        times, differs, same = asyncio.run(go())
    finally:
        asyncio.run(engine.close())
    later = times[1:] or times
    push_s = statistics.median(later)
    return {
        "backend": "vllm",
        "model": str(model),
        "platform": "cuda" if cuda else "cpu",
        "transport": transport,
        "bytes": total_bytes,
        "tensors": len(original),
        "bucket_bytes": bucket_bytes,
        "pushes": pushes,
        "first_push_s": round(times[0], 4),
        "push_s": round(push_s, 4),
        "best_push_s": round(min(later), 4),
        "gbps": round(total_bytes / push_s / 1e9, 2),
        "best_gbps": round(total_bytes / min(later) / 1e9, 2),
        "perturbed_push_changed_weights": differs,
        "original_push_restored_weights": same,
        "copy_plan": bool(options.get("copy_plan", True)) and cuda,
        "checksum": _get(args, "checksum", "sum64"),
        "apply_mode": options.get("weight_apply_mode", "staged"),
        "transport_options": transport_options,
        "phases_median_s": {k: round(statistics.median(p[k] for p in phases[1:] or phases), 6)
                            for k in (phases[0] if phases else {})},
    }


def _phases(engine: Any, push_s: float) -> dict[str, float]:
    """One push's time by phase: the driver's RPC round trip, worker 0's own account of it, the
    prefix-cache reset after it, and what is left (session, manifest, event-loop hops)."""
    last = getattr(engine, "last_receive", None) or {}
    worker = (last.get("workers") or [None])[0] or {}
    out = {"push": push_s, "rpc": float(last.get("rpc_s", 0.0)), "reset_prefix_cache": float(getattr(engine, "last_reset_s", 0.0))}
    out.update({f"worker_{k}": float(v) for k, v in worker.items()})
    out["outside_rpc"] = push_s - out["rpc"] - out["reset_prefix_cache"]
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout_engines_vllm.bench {generate,push} [--json] ...``"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rollout_engines_vllm.bench")
    sub = parser.add_subparsers(dest="what", required=True)
    for name in ("generate", "push"):
        p = sub.add_parser(name)
        p.add_argument("--model", default=None)
        p.add_argument("--json", action="store_true")
        p.add_argument("--option", action="append", default=[], metavar="K=V",
                       help="engine option; 'transport.K=V' sets a weight-transport option (push)")
        if name == "generate":
            p.add_argument("--prompts", type=int, default=64)
            p.add_argument("--prompt-len", type=int, default=32)
            p.add_argument("--max-tokens", type=int, default=64)
            p.add_argument("--repeats", type=int, default=3)
        else:
            p.add_argument("--transport", default=None)
            p.add_argument("--pushes", type=int, default=5)
            p.add_argument("--bucket-mb", type=float, default=512)
            p.add_argument("--checksum", default="sum64", choices=["sum64", "none"], help="per-bucket checksum")
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
