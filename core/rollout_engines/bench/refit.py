"""`rollout-engines bench refit --backend B --model M --json`: the colocated refit cycle.

A trainer sharing the GPU with the engine does, every step: ``sleep(level=L)`` (give the memory
to training) → ``wake_up(tags=["weights"])`` → push the new weights → ``wake_up(tags=["kv_cache"])``
→ generate again. This benchmark runs ``--cycles`` such cycles and times each phase, plus the
first token after waking (one greedy generate of one token). ``refit`` is
``wake_weights + push + wake_kv``: the time from "training is done" to "the engine can generate".
With ``--overlap-kv`` the KV cache wakes while the push runs (``asyncio.gather``: a trainer can do
the same), and ``refit`` is ``wake_weights + push_and_kv``, the pair's time. ``--idle-s`` waits,
untimed, between each cycle's sleep and its wake-up, as the trainer's step does; ``--serve-s``
waits, untimed, with the engine awake before each cycle's sleep, as the rollouts between two
refits do. Without them the cycles run back to back, which no trainer does: on a GPU, memory
mapped again right after it was released maps more slowly (``benchmarks/RESULTS.md``).
``--trainer-step`` puts a trainer's use of the memory into each cycle, untimed, right after the
sleep: one tensor takes what the sleep freed (on a GPU, the bytes the device reported freed, less
512 MiB of slack; elsewhere, the weights' bytes), is written, and is freed again
(``torch.cuda.empty_cache()`` on a GPU); ``--idle-s`` then follows. With ``--idle-s 0`` the
wake-up maps memory the trainer freed a moment before, the case the driver maps slowest.

The weight-sync session is opened once, before the first cycle, as a trainer does, and
``--warmup`` untimed pushes (4, alternating the two weight sets as the cycles do) go first: a
trainer's loop runs thousands of cycles, and the first pushes of each set pay one-time costs (a
copy plan, IPC mappings: zero-copy ``cuda_ipc`` keeps a set mapped once its second push shows the
trainer keeps it; without the warm-up, a 14B shape's pushes in the first cycles waited ~27 ms for
those mappings). The first cycle may still pay others (the first sleep), so the medians and p90s
are over cycles 2..N (all cycles when ``--cycles 1``); ``first_cycle_s`` reports cycle 1 on its own.

Each push is verified as in ``bench push``: cycles alternate perturbed and original weights, and
the engine's weights fingerprint (``diagnostics(fingerprint=True)``, e.g. vLLM on CUDA) or else
its greedy tokens must differ from the start after a perturbed push and equal it after an original
one. Greedy tokens are exact on tiny models; on real-size random models on a GPU they are not
reproducible token for token, so a greedy-token mismatch there leaves ``verified`` false with
``fingerprint: "greedy tokens"`` telling why.

On a GPU, ``sleep_freed_gb`` is what the device reported freed right after each sleep returned,
and ``freed_at_wake_gb`` the same right before the wake-up (after ``--idle-s``): whether the
memory a sleep gives back is there for the trainer when the call returns.

``engine_workers`` is what the engine's workers said of themselves at the start
(``info().extra['workers']``; vLLM's include how many sleep-mode allocations the weights take).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from .common import (
    WARMUP_PUSHES,
    Fingerprint,
    PushBench,
    add_push_arguments,
    arg,
    idle_seconds,
    p90,
    pause_seconds,
    push_weights,
    seconds_type,
)

PHASES = ("sleep", "wake_weights", "push", "wake_kv", "push_and_kv", "first_token", "refit")
#: What ``--trainer-step`` leaves of the memory a sleep freed, for the allocator's rounding.
TRAINER_SLACK = 512 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_push_arguments(parser, checksum="none")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--level", type=int, default=2, help="sleep level")
    parser.add_argument("--overlap-kv", action="store_true",
                        help="wake the KV cache while the push runs (asyncio.gather of the two); "
                        "refit is then wake_weights + push_and_kv, and push / wake_kv are each call's own time")
    parser.add_argument("--idle-s", type=idle_seconds, default=0.0, metavar="SECONDS",
                        help="seconds between each cycle's sleep and its wake-up, untimed: the trainer's step; "
                        "a wake-up right after a sleep maps its memory more slowly (benchmarks/RESULTS.md)")
    parser.add_argument("--serve-s", type=seconds_type("--serve-s"), default=0.0, metavar="SECONDS",
                        help="seconds the engine stays awake before each cycle's sleep, untimed: the rollouts "
                        "between two refits")
    parser.add_argument("--trainer-step", action="store_true",
                        help="after each sleep, untimed: take the memory the sleep freed in one tensor, write "
                        "it and free it (torch.cuda.empty_cache() on a GPU), as a trainer's step does; "
                        "--idle-s follows it")


def run(args: Any) -> dict[str, Any]:
    idle_s = pause_seconds(args, "idle_s")
    serve_s = pause_seconds(args, "serve_s")

    import torch

    from ..errors import CapabilityError
    from ..types import GenerateRequest, SamplingParams
    from ..weights.session import connect_weight_sync
    from .push import _phases

    bench = PushBench.start(args, checksum="none")
    engine, model = bench.engine, bench.model
    #: Each cycle's push by phase (the engine's own account, as ``bench push`` reports it).
    push_phases: list[dict[str, float]] = []
    cycles = max(1, int(arg(args, "cycles", 5)))
    warmup = max(0, int(arg(args, "warmup", WARMUP_PUSHES)))
    level = int(arg(args, "level", 2))
    overlap = bool(arg(args, "overlap_kv", False))
    trainer_step = bool(arg(args, "trainer_step", False))
    try:
        caps = engine.capabilities
        if level not in caps.sleep_levels:
            supported = ", ".join(str(s) for s in caps.sleep_levels) or "none (sleep is not supported)"
            raise CapabilityError(
                f"backend '{bench.backend}' does not support sleep level {level}; supported levels: {supported}"
            )
        weights = asyncio.run(push_weights(engine, model, arg(args, "transport", None),
                                            one_set=bool(arg(args, "one_set", False))))
        original, changed, transport, gpu = weights.original, weights.changed, weights.transport, weights.gpu
        probe = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]],
                                sampling=SamplingParams(temperature=0, max_tokens=8))
        one_token = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]],
                                    sampling=SamplingParams(temperature=0, max_tokens=1))
        fingerprint = Fingerprint(engine, probe)

        def sync_device() -> None:
            if gpu:
                torch.cuda.synchronize()

        async def timed(phase: str, row: dict[str, float], work: Any, *, sync: bool = True) -> Any:
            """``work``'s time into ``row[phase]``; ``sync=False`` for one of two overlapped calls,
            whose pair is timed (and synced) as a whole."""
            if sync:
                sync_device()
            t0 = time.perf_counter()
            out = await work
            if sync:
                sync_device()
            row[phase] = time.perf_counter() - t0
            return out

        workers: list[Any] = []
        #: Per cycle on a GPU: bytes the device reported free beyond what it had before the sleep,
        #: right after the sleep returned and right before the wake-up (after ``--idle-s``).
        freed: list[tuple[int, int]] = []

        def free_bytes() -> int:
            return int(torch.cuda.mem_get_info()[0]) if gpu else 0

        #: Bytes each cycle's trainer step took (``--trainer-step``).
        stepped: list[int] = []

        def train_in(freed_bytes: int) -> None:
            """A trainer's step in the memory the sleep freed: one tensor written, then freed."""
            size = max(0, freed_bytes - TRAINER_SLACK) if gpu else weights.total_bytes
            step = torch.empty(size, dtype=torch.uint8, device="cuda" if gpu else "cpu")
            step.fill_(1)
            sync_device()
            del step
            if gpu:
                torch.cuda.empty_cache()
            stepped.append(size)

        async def go() -> tuple[list[dict[str, float]], list[bool]]:
            workers.extend((await engine.info()).extra.get("workers") or [])
            start_print = await fingerprint()
            await engine.generate(one_token)  # warm the one-token path once, outside the timings
            sync = await connect_weight_sync([engine], transport, bucket_bytes=bench.bucket_bytes, timeout_s=600,
                                             checksum=bench.checksum, options=bench.transport_options)
            rows: list[dict[str, float]] = []
            checks: list[bool] = []
            try:
                for i in range(warmup):  # untimed, awake; the last one leaves the originals when even
                    await sync.push(weights.use(original if i % 2 else changed), version=engine.weight_version + 1)
                for i in range(cycles):
                    tensors = weights.use(changed if i % 2 == 0 else original)  # untimed
                    row: dict[str, float] = {}
                    if serve_s:
                        await asyncio.sleep(serve_s)  # untimed: the rollouts between two refits
                    before = free_bytes()
                    await timed("sleep", row, engine.sleep(level=level))
                    at_sleep = free_bytes()
                    if trainer_step:
                        train_in(at_sleep - before)  # untimed: the trainer's use of the memory
                    if idle_s:
                        await asyncio.sleep(idle_s)  # untimed: the (rest of the) trainer's step
                    if gpu:
                        freed.append((at_sleep - before, free_bytes() - before))
                    await timed("wake_weights", row, engine.wake_up(tags=["weights"]))
                    push = sync.push(tensors, version=engine.weight_version + 1)
                    if overlap:
                        await timed("push_and_kv", row, asyncio.gather(
                            timed("push", row, push, sync=False),
                            timed("wake_kv", row, engine.wake_up(tags=["kv_cache"]), sync=False)))
                    else:
                        await timed("push", row, push)
                    push_phases.append(_phases(await engine.diagnostics(), row["push"], sync.last_send_timings))  # untimed
                    if not overlap:
                        await timed("wake_kv", row, engine.wake_up(tags=["kv_cache"]))
                        row["push_and_kv"] = row["push"] + row["wake_kv"]
                    await timed("first_token", row, engine.generate(one_token))
                    row["refit"] = row["wake_weights"] + row["push_and_kv"]
                    rows.append(row)
                    now = await fingerprint()  # untimed
                    checks.append(now != start_print if i % 2 == 0 else now == start_print)
                if cycles % 2 == 1:  # leave the engine on its original weights, and check that too
                    await sync.push(weights.use(original), version=engine.weight_version + 1)
                    checks.append(await fingerprint() == start_print)
            finally:
                await sync.close()
            return rows, checks

        rows, checks = asyncio.run(go())
    finally:
        asyncio.run(engine.close())
    later = rows[1:] or rows
    push_s = statistics.median(r["push"] for r in later)
    return {
        "backend": bench.backend,
        "model": model,
        "platform": "cuda" if gpu else "cpu",
        "transport": transport,
        "sleep_level": level,
        "overlap_kv": overlap,
        "idle_s": idle_s,
        "serve_s": serve_s,
        "trainer_step": trainer_step,
        # GB each cycle's trainer step took and freed (median of cycles 2..N); None without the step
        "trainer_step_gb": _median_gb(stepped[1:] or stepped),
        "cycles": cycles,
        "warmup_pushes": warmup,
        "bytes": weights.total_bytes,
        "tensors": len(original),
        "bucket_bytes": bench.bucket_bytes,
        "trainer_sets": 2 if weights.live is None else 1,
        "checksum": bench.checksum,
        "median_s": {p: round(statistics.median(r[p] for r in later), 6) for p in PHASES},
        "p90_s": {p: round(p90([r[p] for r in later]), 6) for p in PHASES},
        "first_cycle_s": {p: round(rows[0][p], 6) for p in PHASES},
        "push_phases_median_s": {
            k: round(statistics.median(p[k] for p in (push_phases[1:] or push_phases)), 6) for k in push_phases[0]
        },
        "push_gbps": round(weights.total_bytes / push_s / 1e9, 2),
        "best_push_gbps": round(weights.total_bytes / min(r["push"] for r in later) / 1e9, 2),
        "fingerprint": fingerprint.kind,
        "pushes_verified": checks,
        "verified": all(checks),
        "options": bench.options,
        "transport_options": bench.transport_options,
        "engine_workers": workers,
        # GB the device reported freed by the sleep (median of cycles 2..N): right after it
        # returned, and right before the wake-up; None without a GPU
        "sleep_freed_gb": _median_gb([f[0] for f in freed[1:] or freed]),
        "freed_at_wake_gb": _median_gb([f[1] for f in freed[1:] or freed]),
    }


def _median_gb(values: list[int]) -> float | None:
    return round(statistics.median(values) / 1e9, 3) if values else None
