"""`rollout-engines bench push --backend B --model M --json`: weight pushes into a running engine.

Seconds per push and GB/s end to end, from ``WeightSync.push`` called to every worker done (and,
for backends with a prefix cache, the cache reset after it). The first push pays one-time costs
(a copy plan, IPC mappings); later pushes alternate perturbed and original weights, held by the
trainer (this process) on the transport's device. ``push_s`` is the median of pushes 2..N.

Correctness is checked on the way with the weights fingerprint of the engine's
``diagnostics(fingerprint=True)`` when it makes one (vLLM on CUDA: the workers' parameter sums),
else its greedy tokens (exact on tiny models; real-size random models on a GPU are not reproducible
token for token, so ``verified`` is then null): after a perturbed push it differs from the start,
after pushing the originals it is equal again.

``phases_median_s`` reports what the engine's :meth:`~rollout_engines.engine.EngineProtocol.diagnostics`
says of each push: the RPC into its workers, worker 0's own timings, the prefix-cache reset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from ..types import Diagnostics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    parser.add_argument("--transport", default=None, help="default: cuda_ipc on a GPU, shm on the CPU")
    parser.add_argument("--pushes", type=int, default=6)
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--checksum", default="pos64", choices=["pos64", "sum64", "none"], help="per-bucket checksum")
    parser.add_argument("--option", action="append", default=[], metavar="K=V",
                        help="engine option (JSON values); 'transport.K=V' sets a weight-transport option")
    parser.add_argument("--generate-between", action="store_true",
                        help="generate a small batch after every push (untimed), as an RL loop does, so each "
                        "push also pays the engine's prefix-cache reset")


def arg(args: Any, name: str, default: Any) -> Any:
    """``args.name`` (an argparse namespace) or ``args[name]`` (a dict), ``default`` when unset."""
    value = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
    return default if value is None else value


def parse_options(args: Any) -> dict[str, Any]:
    """``--option K=V`` pairs (values parsed as JSON where they parse) plus an ``options`` dict."""
    out: dict[str, Any] = dict(arg(args, "options", {}))
    for item in arg(args, "option", []):
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _phases(diagnostics: Diagnostics, push_s: float) -> dict[str, float]:
    """One push's time by phase: the host's RPC round trip into its workers, worker 0's own account,
    the prefix-cache reset after it, and what is left (session, manifest, event-loop hops)."""
    last = diagnostics.last_receive
    out = {"push": push_s}
    if last is not None and last.rpc_s is not None:
        out["rpc"] = last.rpc_s
    if last is not None and last.workers:
        out.update({f"worker_{k}": v for k, v in last.workers[0].phases().items()})
    if diagnostics.last_reset_s is not None:
        out["reset_prefix_cache"] = diagnostics.last_reset_s
    out["outside_rpc"] = push_s - out.get("rpc", 0.0) - out.get("reset_prefix_cache", 0.0)
    return out


def run(args: Any) -> dict[str, Any]:
    import torch

    from ..factory import create_engine
    from ..types import GenerateRequest, SamplingParams
    from ..weights.checkpoint import load_checkpoint, perturbed
    from ..weights.session import connect_weight_sync

    backend = arg(args, "backend", "vllm")
    model = arg(args, "model", None)
    if model is None:
        from ..testing.tiny_model import tiny_model_path

        model = str(tiny_model_path())
    pushes = max(1, int(arg(args, "pushes", 6)))
    between = bool(arg(args, "generate_between", False))
    bucket_bytes = int(float(arg(args, "bucket_mb", 512)) * 2**20)
    checksum = arg(args, "checksum", "pos64")
    options = parse_options(args)
    transport_options = {k.removeprefix("transport."): v for k, v in options.items() if k.startswith("transport.")}
    options = {k: v for k, v in options.items() if not k.startswith("transport.")}
    engine = create_engine(backend, model=str(model), **options)
    try:
        facts = asyncio.run(engine.diagnostics())
        gpu = (facts.platform or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
        transport = arg(args, "transport", None) or ("cuda_ipc" if gpu else "shm")
        dtype_name = facts.weights_dtype or (engine.config.dtype if engine.config.dtype != "auto" else None)
        dtype = None
        if dtype_name is not None:
            from ..weights.buckets import torch_dtype

            dtype = torch_dtype(dtype_name.removeprefix("torch."))
        device = "cuda" if transport in ("cuda_ipc", "nccl") else "cpu"
        original = {k: v.to(device) for k, v in load_checkpoint(str(model), dtype=dtype).items()}
        changed = {k: v.to(device) for k, v in perturbed(load_checkpoint(str(model), dtype=dtype)).items()}
        total_bytes = sum(t.numel() * t.element_size() for t in original.values())
        request = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=SamplingParams(temperature=0, max_tokens=8))
        own_print = False

        async def fingerprint() -> Any:
            nonlocal own_print
            weights = (await engine.diagnostics(fingerprint=True)).weights_fingerprint
            own_print = weights is not None
            if own_print:
                return weights
            return [c.token_ids for c in await engine.generate(request)]

        async def go() -> tuple[list[float], list[dict[str, float]], bool, bool]:
            start_print = await fingerprint()
            sync = await connect_weight_sync([engine], transport, bucket_bytes=bucket_bytes, timeout_s=600,
                                             checksum=checksum, options=transport_options)
            times: list[float] = []
            phases: list[dict[str, float]] = []
            differs = False
            try:
                for i in range(pushes):
                    tensors = changed if i % 2 == 0 else original
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    await sync.push(tensors, version=engine.weight_version + 1)
                    times.append(time.perf_counter() - t0)
                    phases.append(_phases(await engine.diagnostics(), times[-1]))
                    if between:  # as in an RL loop: rollouts fill the prefix cache between pushes
                        await engine.generate(request)
                    if i == 0:
                        differs = await fingerprint() != start_print
                await sync.push(original, version=engine.weight_version + 1)
                same = await fingerprint() == start_print
            finally:
                await sync.close()
            return times, phases, differs, same

        times, phases, differs, same = asyncio.run(go())
    finally:
        asyncio.run(engine.close())
    later = times[1:] or times
    push_s = statistics.median(later)
    return {
        "backend": backend,
        "model": str(model),
        "platform": "cuda" if gpu else "cpu",
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
        "fingerprint": "weights" if own_print else "greedy tokens",
        "perturbed_push_changed_weights": differs,
        "original_push_restored_weights": same,
        "checksum": checksum,
        "options": options,
        "transport_options": transport_options,
        "generate_between_pushes": between,
        "phases_median_s": {k: round(statistics.median(p[k] for p in phases[1:] or phases), 6)
                            for k in (phases[0] if phases else {})},
    }

