"""Timeline of steady pushes (trainer process and one receiver process), on the monotonic clock.

    PYTHONPATH=benchmarks python benchmarks/trace_cuda_ipc.py --bucket-mb 512 --pushes 12

Wraps library methods in both processes to log when each step happens (the receiver is built by
``TracedBench``, so this module must be importable there: hence PYTHONPATH). Prints one JSON line
(best and median push, ratio to a same-run device copy), then the last three pushes as
``P:`` (trainer) / ``C:`` (receiver) events with microseconds since ``push()`` began.
``--transport shm --size-mb 64`` runs it on a CPU. ``TRACE_APPLY=foreach`` makes the receiver copy
with an eager ``_foreach_copy_`` instead of the core's SteadyCopier; ``TRACE_SWITCH=S`` sets
``sys.setswitchinterval(S)`` in both processes; ``TRACE_THREAD=1`` has the receiver receive on a
worker thread (as ``bench weight-sync --receive-thread``).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from multiprocessing.connection import Connection

EVENTS: list[tuple[str, int]] = []


def ev(name: str) -> None:
    EVENTS.append((name, time.monotonic_ns()))


def wrap(obj, attr, label, *, start=True, end=True, arg_index=None):
    fn = getattr(obj, attr)
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def aw(*a, **k):
            tag = label if arg_index is None else f"{label}{a[arg_index]}"
            if start:
                ev(tag + ">")
            try:
                return await fn(*a, **k)
            finally:
                if end:
                    ev(tag + "<")
        setattr(obj, attr, aw)
    else:
        @functools.wraps(fn)
        def w(*a, **k):
            tag = label if arg_index is None else f"{label}{a[arg_index]}"
            if start:
                ev(tag + ">")
            try:
                return fn(*a, **k)
            finally:
                if end:
                    ev(tag + "<")
        setattr(obj, attr, w)


def patch_common() -> None:
    orig = Connection.recv

    def recv(self):
        out = orig(self)
        ev("pipe_recv")
        return out
    Connection.recv = recv
    osend = Connection.send

    def send(self, obj):
        ev("pipe_send")
        return osend(self, obj)
    Connection.send = send
    sw = os.environ.get("TRACE_SWITCH")
    if sw:
        sys.setswitchinterval(float(sw))


def patch_child() -> None:
    from rollout_engines import process
    from rollout_engines.bench import weight_sync
    from rollout_engines.weights.transports import _slots, cuda_ipc
    patch_common()
    wrap(process, "_dispatch", "dispatch")
    wrap(weight_sync.BenchReceiverEngine, "_receive", "thread")
    wrap(_slots.SlotReceiver, "recv_bucket", "recv", start=False, arg_index=1)
    wrap(_slots.SlotReceiver, "_read_log", "log", start=False)
    wrap(_slots.SlotReceiver, "release", "rel", start=False, arg_index=1)
    wrap(cuda_ipc.CudaIpcReceiver, "_before_ack", "sync")
    if os.environ.get("TRACE_APPLY") == "foreach":
        import torch

        def apply(self, named, *, owned):
            torch._foreach_copy_([self.tensors[n] for n, _ in named], [t for _, t in named], non_blocking=True)
        weight_sync._Preallocated.apply = apply


def TracedBench(config):
    from rollout_engines.bench.weight_sync import BenchReceiverEngine

    patch_child()

    class T(BenchReceiverEngine):
        def _extra_info(self):
            out = super()._extra_info()
            out["events"] = list(EVENTS)
            EVENTS.clear()
            return out
    return T(config)


async def main(args) -> None:
    import torch
    from rollout_engines.bench.weight_sync import make_state, memcpy_gbps
    from rollout_engines.process import ProcessEngine
    from rollout_engines.types import EngineConfig
    from rollout_engines.weights import session
    from rollout_engines.weights.manifest import specs_of
    from rollout_engines.weights.transports import _slots

    patch_common()
    wrap(session.WeightSync, "push", "push")
    wrap(session.WeightSync, "_stream", "stream")
    wrap(_slots.SlotSender, "_publish", "pub", start=False)
    wrap(_slots.SlotSender, "end", "end")
    wrap(ProcessEngine, "_call", "call")
    wrap(ProcessEngine, "receive_weights", "rw", end=False)
    dev = torch.device("cuda", 0) if args.transport == "cuda_ipc" else torch.device("cpu")
    state = make_state(args.size_mb, 320, dev)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    specs = [s.model_dump() for s in specs_of(list(state.items()))]
    eng = ProcessEngine(EngineConfig(backend="bench-receiver", model="-", device=str(dev),
                                     options={"specs": specs, "threads": 1,
                                              "receive_inline": not os.environ.get("TRACE_THREAD")}), factory="trace_cuda_ipc:TracedBench")
    sync = await session.connect_weight_sync([eng], args.transport, bucket_bytes=int(args.bucket_mb * 2**20),
                                             checksum="none", progress=False)
    times = []
    EVENTS.clear()
    for v in range(args.pushes):
        await sync.push(state, version=v + 1)
        times.append(sync.last_push_seconds)
        if v == 0:
            EVENTS.clear()
    base = memcpy_gbps(nbytes, dev, repeats=5)
    parent = list(EVENTS)
    info = await eng.info()
    child = info.extra["events"]
    await sync.close()
    await eng.close()
    starts = [t for n, t in parent if n == "push>"]
    allev = sorted([("P:" + n, t) for n, t in parent] + [("C:" + n, t) for n, t in child], key=lambda x: x[1])
    best = min(times[1:])
    print(json.dumps({"bucket_mb": args.bucket_mb, "switch": os.environ.get("TRACE_SWITCH"),
                      "best_ms": round(best * 1e3, 3), "median_ms": round(sorted(times[1:])[len(times[1:]) // 2] * 1e3, 3),
                      "ratio": round(nbytes / best / 1e9 / base, 3), "d2d_gbps": round(base, 1)}))
    for i, s0 in enumerate(starts[-3:]):
        nxt = starts[starts.index(s0) + 1] if starts.index(s0) + 1 < len(starts) else 1 << 62
        line = [f"{n}@{(t - s0) / 1e3:.0f}" for n, t in allev if s0 <= t < nxt and not n.startswith("C:log")]
        logs = sum(1 for n, t in allev if s0 <= t < nxt and n.startswith("C:log"))
        print(f"push {i}: logreads={logs} " + " ".join(line))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--pushes", type=int, default=12)
    p.add_argument("--size-mb", type=float, default=3072)
    p.add_argument("--transport", default="cuda_ipc")
    asyncio.run(main(p.parse_args()))
