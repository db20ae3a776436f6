"""`rollout-engines bench push --backend B --model M --json`: weight pushes into a running engine.

Seconds per push and GB/s end to end, from ``WeightSync.push`` called to every worker done (and,
for backends with a prefix cache, the cache reset after it). Pushes alternate perturbed and
original weights, held by the trainer (this process) on the transport's device. The first ones pay
one-time costs (a copy plan, IPC mappings, the sender learning that the trainer keeps both sets,
copy graphs), so ``--warmup`` pushes (4) go untimed first (``first_push_s`` is the very first);
``push_s`` is the median of the ``--pushes`` after them (with ``--warmup 0``: of pushes 2..N, as
before 2026-12-04), ``push_p90_s`` their nearest-rank 90th percentile and ``push_times_s`` each of
them in order (a full collection of Python's collector, a slow machine: the tail shows it).
With ``--one-set`` the trainer keeps one set of tensors on its device and rewrites it before each
push (untimed) from the two sets in host memory, as an optimizer step rewrites its parameters: a
model whose two sets do not fit beside the engine on one GPU (``trainer_sets`` says which).
``--generate-between`` runs a request after every push (as an RL loop's rollouts do); ``--idle-s``
waits, untimed, before each push (a trainer's step: a push right after a request also times the
engine and its client finishing it).

Correctness is checked on the way with the weights fingerprint of the engine's
``diagnostics(fingerprint=True)`` when it makes one (vLLM on CUDA: the workers' parameter sums),
else its greedy tokens (exact on tiny models; real-size random models on a GPU are not reproducible
token for token, so ``verified`` is then null): after a perturbed push it differs from the start,
after pushing the originals it is equal again.

``device_copy_gbps`` is measured in the same run, between pushes (the best of those measurements):
one copy of the state's bytes on the trainer's device, in chunks of at most 1 GiB; ``ratio`` =
``gbps`` / ``device_copy_gbps`` (1.0: a push as fast as copying the weights once on the device).
``host_loop_us`` is the host's Python speed, sampled beside that baseline (one small loop; median,
fastest, slowest in microseconds): a push's CPU-bound phases move with it, so two runs' figures
compare best where it agrees.

``phases_median_s`` reports what the engine's :meth:`~rollout_engines.engine.EngineProtocol.diagnostics`
says of each push: the RPC into its workers, worker 0's own timings, the prefix-cache reset.
``engine_extra`` is what the engine's ``info().extra`` said after the pushes (its plain values;
e.g. SGLang's ``relay_forwarded_buckets``: how many buckets its relay forwarded to SGLang's loader
instead of staging them).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from ..types import Diagnostics
from .common import (
    WARMUP_PUSHES,
    Fingerprint,
    PushBench,
    add_push_arguments,
    arg,
    host_speed,
    idle_seconds,
    memcpy_gbps,
    p90,
    pause_seconds,
    push_weights,
    python_loop_s,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_push_arguments(parser, checksum="pos64")
    parser.add_argument("--pushes", type=int, default=6)
    parser.add_argument("--generate-between", action="store_true",
                        help="generate a small batch after every push (untimed), as an RL loop does, so each "
                        "push also pays the engine's prefix-cache reset")
    parser.add_argument("--idle-s", type=idle_seconds, default=0.0, metavar="SECONDS",
                        help="seconds before each push, untimed: the trainer's step (after the requests of "
                        "--generate-between); a push right after a request also times the engine and its "
                        "client finishing that request")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="push a LoRA adapter of this rank (WeightSync.push_lora) instead of the full weights; "
                        "vLLM needs --option enable_lora=true and max_lora_rank >= the rank")


def _median_phases(phases: list[dict[str, float]], *, skip_first: bool = True) -> dict[str, float]:
    """The median of each phase over the pushes (after the first unless ``skip_first`` is false;
    all, where there is one)."""
    later = (phases[1:] if skip_first else phases) or phases
    return {k: round(statistics.median(p.get(k, 0.0) for p in later), 6) for k in (phases[0] if phases else {})}


def _phases(diagnostics: Diagnostics, push_s: float, sent: dict[str, float] | None = None) -> dict[str, float]:
    """One push's time by phase: the host's RPC round trip into its workers, worker 0's own account,
    the prefix-cache reset after it, what is left (session, manifest, event-loop hops), and the
    trainer's sender (``WeightSync.last_send_timings``: when its first bucket went out, when it was
    done)."""
    last = diagnostics.last_receive
    out = {"push": push_s}
    out.update({f"trainer_{k}": v for k, v in (sent or {}).items()})
    if last is not None and last.rpc_s is not None:
        out["rpc"] = last.rpc_s
    if last is not None and last.workers:
        out.update({f"worker_{k}": v for k, v in last.workers[0].phases().items()})
    if diagnostics.last_reset_s is not None:
        out["reset_prefix_cache"] = diagnostics.last_reset_s
    out["outside_rpc"] = push_s - out.get("rpc", 0.0) - out.get("reset_prefix_cache", 0.0)
    return out


def run(args: Any) -> dict[str, Any]:
    if arg(args, "lora_rank", None) is not None:
        return run_lora(args)
    import torch

    from ..types import GenerateRequest, SamplingParams
    from ..weights.session import connect_weight_sync

    idle_s = pause_seconds(args, "idle_s")  # before an engine starts
    bench = PushBench.start(args, checksum="pos64")
    engine, model = bench.engine, bench.model
    pushes = max(1, int(arg(args, "pushes", 6)))
    warmup = max(0, int(arg(args, "warmup", WARMUP_PUSHES)))
    between = bool(arg(args, "generate_between", False))
    try:
        weights = asyncio.run(push_weights(engine, model, arg(args, "transport", None),
                                            one_set=bool(arg(args, "one_set", False))))
        original, changed, transport = weights.original, weights.changed, weights.transport
        request = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=SamplingParams(temperature=0, max_tokens=8))
        fingerprint = Fingerprint(engine, request)

        extra: dict[str, Any] = {}

        loops: list[float] = []  # the host's Python speed, sampled between pushes

        async def go() -> tuple[list[float], list[dict[str, float]], bool, bool, list[float]]:
            start_print = await fingerprint()
            sync = await connect_weight_sync([engine], transport, bucket_bytes=bench.bucket_bytes, timeout_s=600,
                                             checksum=bench.checksum, options=bench.transport_options)
            times: list[float] = []  # every push, the warm-up ones first
            phases: list[dict[str, float]] = []
            copies: list[float] = []
            differs = False
            try:
                for i in range(warmup + pushes):
                    tensors = weights.use(changed if i % 2 == 0 else original)  # untimed
                    if idle_s:
                        await asyncio.sleep(idle_s)  # untimed: the trainer's step
                    if weights.device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    await sync.push(tensors, version=engine.weight_version + 1)
                    times.append(time.perf_counter() - t0)
                    if i >= warmup:
                        phases.append(_phases(await engine.diagnostics(), times[-1], sync.last_send_timings))
                    if between:  # as in an RL loop: rollouts fill the prefix cache between pushes
                        await engine.generate(request)
                    if i == 0:
                        differs = await fingerprint() != start_print
                    if i >= warmup and ((i - warmup) % 2 == 1 or pushes == 1):  # the same-run baseline, between pushes
                        copies.append(memcpy_gbps(weights.total_bytes, weights.device, repeats=2))
                        loops.append(python_loop_s())  # where the copy's baseline is: untimed, beside it
                await sync.push(weights.use(original), version=engine.weight_version + 1)
                same = await fingerprint() == start_print
                extra.update(scalar_extras((await engine.info()).extra))  # while the transfer is open
            finally:
                await sync.close()
            return times, phases, differs, same, copies

        times, phases, differs, same, copies = asyncio.run(go())
    finally:
        asyncio.run(engine.close())
    # Timed: the pushes after the warm-up (without one, after the first push, which maps memory).
    later = times[warmup:] if warmup else (times[1:] or times)
    total_bytes = weights.total_bytes
    push_s = statistics.median(later)
    return {
        "backend": bench.backend,
        "model": model,
        "platform": "cuda" if weights.gpu else "cpu",
        "transport": transport,
        "bytes": total_bytes,
        "tensors": len(original),
        "bucket_bytes": bench.bucket_bytes,
        "trainer_sets": 2 if weights.live is None else 1,
        "pushes": pushes,
        "warmup_pushes": warmup,
        "first_push_s": round(times[0], 4),
        "push_s": round(push_s, 4),
        "best_push_s": round(min(later), 4),
        "push_p90_s": round(p90(later), 4),
        "push_times_s": [round(t, 4) for t in later],
        "gbps": round(total_bytes / push_s / 1e9, 2),
        "best_gbps": round(total_bytes / min(later) / 1e9, 2),
        "device_copy_gbps": round(max(copies), 2),
        "ratio": round(total_bytes / push_s / 1e9 / max(copies), 3),
        "fingerprint": fingerprint.kind,
        "perturbed_push_changed_weights": differs,
        "original_push_restored_weights": same,
        "checksum": bench.checksum,
        "options": bench.options,
        "transport_options": bench.transport_options,
        "generate_between_pushes": between,
        "idle_s": idle_s,
        "host_loop_us": host_speed(loops),
        "phases_median_s": _median_phases(phases, skip_first=not warmup),
        "engine_extra": extra,
    }


def scalar_extras(extra: dict[str, Any]) -> dict[str, Any]:
    """The engine's ``info().extra`` entries that are plain JSON scalars (what the engine says
    about itself after the pushes, e.g. how SGLang's relay handed buckets over)."""
    return {k: v for k, v in extra.items() if v is None or isinstance(v, bool | int | float | str)}


def run_lora(args: Any) -> dict[str, Any]:
    """``--lora-rank R``: pushes of one adapter (PEFT names, random non-zero ``A`` and ``B``, every
    ``q_proj``/``v_proj`` or the model's first two projections) alternating two sets of tensors under
    increasing adapter versions. Verified by the engine's adapter listing (``info().loras`` names
    the last version) and by greedy tokens with the adapter differing from the base model's
    (null where greedy tokens are not reproducible, as on real-size random models on a GPU)."""
    import torch

    from ..types import GenerateRequest, SamplingParams
    from ..weights.lora import make_lora
    from ..weights.session import connect_weight_sync

    bench = PushBench.start(args, checksum="pos64")
    engine, model = bench.engine, bench.model
    pushes = max(1, int(arg(args, "pushes", 6)))
    rank = int(arg(args, "lora_rank", 16))
    try:
        weights = asyncio.run(push_weights(engine, model, arg(args, "transport", None)))
        transport = weights.transport
        spec, first = make_lora(weights.original, "bench-lora", rank=rank, seed=1)
        _, second = make_lora(weights.original, "bench-lora", rank=rank, seed=2)
        sets = [{k: v.to(weights.device) for k, v in t.items()} for t in (first, second)]
        weights.changed = {}  # not pushed here: give the memory back
        lora_bytes = sum(t.numel() * t.element_size() for t in sets[0].values())
        probe = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=SamplingParams(temperature=0, max_tokens=8))

        async def go() -> tuple[list[float], list[dict[str, float]], bool, bool | None, dict[str, Any]]:
            base = [c.token_ids for c in await engine.generate(probe)]
            sync = await connect_weight_sync([engine], transport, bucket_bytes=bench.bucket_bytes, timeout_s=600,
                                             checksum=bench.checksum, options=bench.transport_options)
            times: list[float] = []
            phases: list[dict[str, float]] = []
            try:
                for i in range(pushes):
                    if weights.device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    await sync.push_lora(spec, sets[i % 2], version=i + 1)
                    times.append(time.perf_counter() - t0)
                    phases.append(_phases(await engine.diagnostics(), times[-1], sync.last_send_timings))
                extra = scalar_extras((await engine.info()).extra)  # while the transfer is open
            finally:
                await sync.close()
            listed = (await engine.info()).loras == {spec.name: pushes}
            adapted = [c.token_ids for c in await engine.generate(probe.model_copy(update={"lora": spec.name}))]
            again = [c.token_ids for c in await engine.generate(probe)]
            changed = (adapted != base) if again == base else None  # None: greedy tokens not reproducible
            await engine.unload_lora(spec.name)
            return times, phases, listed, changed, extra

        times, phases, listed, changed, extra = asyncio.run(go())
    finally:
        asyncio.run(engine.close())
    later = times[1:] or times
    return {
        "backend": bench.backend,
        "model": model,
        "platform": "cuda" if weights.gpu else "cpu",
        "transport": transport,
        "lora_rank": rank,
        "lora_targets": list(spec.target_modules),
        "bytes": lora_bytes,
        "tensors": len(sets[0]),
        "pushes": pushes,
        "first_push_s": round(times[0], 4),
        "push_s": round(statistics.median(later), 4),
        "best_push_s": round(min(later), 4),
        "gbps": round(lora_bytes / statistics.median(later) / 1e9, 3),
        "adapter_listed": listed,
        "adapter_changed_outputs": changed,
        "phases_median_s": _median_phases(phases),
        "checksum": bench.checksum,
        "options": bench.options,
        "engine_extra": extra,
    }
