"""`rollout-engines bench weight-sync --transport T --size-mb N --tensors K --json`.

A synthetic state dict of ``K`` float32 tensors totalling ``N`` MB is pushed, through the real
trainer-side session (:func:`connect_weight_sync`), into ``R`` receiver processes. Each receiver
is a :class:`ProcessEngine` hosting a :class:`WeightReceiver` that copies every tensor into a
preallocated one of the same shape (as an engine's parameters; through the core's
:class:`SteadyCopier`, which replays a steady push's copies as a CUDA graph). The receive runs
on the receiver process's event loop, which serves nothing else meanwhile (``--receive-thread``:
on a worker thread, as an engine that keeps serving requests would). ``seconds`` is the best
push of ``--repeats`` (after one warm-up push that maps memory and builds groups), from the
first byte packed to the last receiver done. ``gbps`` = payload bytes / seconds / 1e9. Where the last
push's time went: ``sender_timings_last_push`` (the trainer's stream: its first bucket out, the
whole stream) and ``receiver_timings_last_push`` (receiver 0's wait, check, apply, total).

``baseline`` is measured in the same run, between the pushes (the best of those measurements,
so a busy moment does not flatter the ratio): memcpy bandwidth (``torch`` copy between two
buffers of the state's size in this process) for the CPU transports, device-to-device copy for
``cuda_ipc``/``nccl``. For ``gloo`` there is also ``raw_broadcast_gbps``: one flat buffer of the
same size broadcast by a raw gloo group to the same number of receiver processes, and
``ratio_vs_raw`` = gbps / raw_broadcast_gbps.

``--changed-fraction F``: a delta benchmark (:mod:`rollout_engines.weights.delta`). The warm-up push
is full; before each timed push, ``F`` of the elements (random positions in every tensor) get new
values, and the session sends only what changed. ``bytes`` stays the state's size (a full push's
payload), ``bytes_sent`` is what the last push put in its buckets (per receiver, alignment included),
``bytes_sent_ratio`` = bytes_sent / bytes, ``full_push_bytes`` the warm-up push's bucket bytes;
``seconds`` / ``gbps`` are those of the delta pushes (gbps over the full state: effective). Receivers
report a digest of their tensors' fingerprints, compared bit for bit with the trainer's state
(``verified``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import multiprocessing as mp
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..engine import Capabilities, Engine, EngineProtocol
from ..types import Completion, EngineConfig, GenerateRequest
from ..weights.copies import SteadyCopier
from ..weights.manifest import TensorSpec, TransportSpec, WeightManifest
from .common import host_speed, memcpy_gbps, python_loop_s

GPU_TRANSPORTS = ("cuda_ipc", "nccl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transport", default="shm", help="gloo, shm, disk, inproc, cuda_ipc, nccl, ...")
    parser.add_argument("--size-mb", type=float, default=1024.0, help="state dict size in MiB")
    parser.add_argument("--tensors", type=int, default=320)
    parser.add_argument(
        "--shape", default=None, metavar="NAME",
        help="push the bf16 tensors of a named model shape (rollout_engines.testing.shapes, e.g. qwen3-14b; "
        "Qwen2 form, as a checkpoint of that shape) instead of --size-mb / --tensors",
    )
    parser.add_argument("--receivers", type=int, default=1, help="receiver processes")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="bucket size in MiB (default: the transport's own default)")
    parser.add_argument("--checksum", default="pos64", choices=["pos64", "sum64", "none"])
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes (best counts), after one warm-up")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--path", default=None, help="directory for --transport disk (default: a temp dir)")
    parser.add_argument(
        "--no-direct", action="store_true",
        help="cuda_ipc: pack every bucket into the IPC-shared slots instead of letting the receiver "
        "read the trainer's tensors where they lie (zero-copy, the default where possible)",
    )
    parser.add_argument(
        "--receive-thread", action="store_true",
        help="receiver processes run each receive on a worker thread of their event loop (as an "
        "engine that keeps serving requests meanwhile) instead of on the loop itself",
    )
    parser.add_argument(
        "--changed-fraction", type=float, default=None, metavar="F",
        help="delta pushes: before each timed push change this fraction of the elements (e.g. 0.02); "
        "reports bytes_sent next to bytes",
    )
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads in every benchmark process, baseline included (0: torch's default). "
        "On a shared, oversubscribed CPU each parallel copy waits for descheduled threads; 1 is faster there",
    )


# ---- the receiving side ---------------------------------------------------------------------------
class _Preallocated:
    """WeightTarget: copies each received tensor into a preallocated one (an engine's parameters)."""

    def __init__(self, specs: Sequence[TensorSpec], device: torch.device) -> None:
        from ..weights.buckets import torch_dtype

        self.specs = {s.name: s for s in specs}
        self.tensors = {s.name: torch.zeros(s.shape, dtype=torch_dtype(s.dtype), device=device) for s in specs}
        self.copier = SteadyCopier()

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        return self.specs

    def apply(self, named: Sequence[tuple[str, torch.Tensor]], *, owned: bool) -> None:
        self.copier.copy([self.tensors[n] for n, _ in named], [t for _, t in named])

    def current(self, name: str) -> torch.Tensor:
        """The tensor as it is now (delta pushes rebuild sparse changes on top of it)."""
        return self.tensors[name]


class BenchReceiverEngine(Engine):
    """The benchmark's receiver: an engine with nothing but a weight receiver (no generation)."""

    backend_name = "bench-receiver"
    capabilities = Capabilities(generate=False, transports=("inproc", "gloo", "nccl", "shm", "disk", "cuda_ipc"))

    def __init__(self, config: EngineConfig) -> None:
        from ..weights.receiver import WeightReceiver

        super().__init__(config)
        if config.options.get("threads"):
            torch.set_num_threads(int(config.options["threads"]))
        specs = [TensorSpec(**s) for s in config.options["specs"]]
        self.device = torch.device(config.device or "cpu")
        self.target = _Preallocated(specs, self.device)
        self.receiver = WeightReceiver(self.target, device=self.device, mode="inplace", label="bench receiver")

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        raise NotImplementedError("the benchmark receiver does not generate")

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        await asyncio.to_thread(self.receiver.connect, spec)

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        if self.config.options.get("receive_inline"):
            # Hosted alone in its process (ProcessEngine), the receiver serves nothing else while
            # it receives, as an engine worker's own thread: no hop to a thread and back (two
            # thread wake-ups, 0.1-0.3 ms of every push; ``--receive-thread`` keeps them).
            self._receive(manifest)
        else:
            await asyncio.to_thread(self._receive, manifest)

    def _receive(self, manifest: WeightManifest) -> None:
        self.receiver.receive(manifest)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _extra_info(self) -> dict[str, Any]:
        from ..weights.delta import digest, fingerprint

        total = sum(float(t.double().sum()) for t in self.target.tensors.values())
        return {
            "checksum": total,
            "digest": digest({n: fingerprint(t) for n, t in self.target.tensors.items()}), "handles_opened": getattr(self.receiver.transport, "opened", None),
            "graph_replays": self.target.copier.replays, "chunked_graphs": self.target.copier.chunked,
            "timings": self.receiver.last_timings,
        }

    async def _close_weight_transfer(self) -> None:
        # Before the trainer closes its store: a receiver still connected would find it gone.
        self.receiver.close()

    async def _close(self) -> None:
        self.receiver.close()


# ---- baselines -----------------------------------------------------------------------------------
def _raw_receiver(port: int, rank: int, world: int, nbytes: int, rounds: int, threads: int) -> None:
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), rank, world, timeout)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for _ in range(rounds):
        pg.broadcast([buf], opts).wait()  # type: ignore[attr-defined]


def raw_gloo_broadcast_gbps(nbytes: int, receivers: int, repeats: int, threads: int = 0) -> float:
    """One flat buffer of ``nbytes`` broadcast over a plain gloo group to ``receivers`` processes."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=600)
    from ..weights.transports._store import loopback_store

    store = loopback_store("127.0.0.1", 0, timeout.total_seconds())
    rounds = repeats + 1
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_raw_receiver, args=(store.port, r, receivers + 1, nbytes, rounds, threads))
             for r in range(1, receivers + 1)]
    for p in procs:
        p.start()
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), 0, receivers + 1, timeout)
        buf = torch.ones(nbytes, dtype=torch.uint8)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        best = float("inf")
        for i in range(rounds):
            # A barrier-free timing: the root's broadcast completes when every receiver has its data.
            start = time.perf_counter()
            pg.broadcast([buf], opts).wait()  # type: ignore[attr-defined]
            if i:
                best = min(best, time.perf_counter() - start)
    finally:
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
    return nbytes / best / 1e9


# ---- the run ---------------------------------------------------------------------------------------
def change_elements(state: Mapping[str, torch.Tensor], fraction: float, seed: int) -> int:
    """Give ``fraction`` of every tensor's elements (random positions) new values; how many changed."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for t in state.values():
            k = round(fraction * t.numel())
            if not k:
                continue
            index = torch.randint(0, t.numel(), (k,), generator=gen).to(t.device)
            flat = t.view(-1)
            flat[index] += 1.0
            changed += k
    return changed


def make_state(size_mb: float, tensors: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors of about equal size (a few shapes, like a transformer's)."""
    total = int(size_mb * 2**20) // 4
    per = max(1, total // tensors)
    cols = 1024 if per >= 1024 else 1
    rows = max(1, per // cols)
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = {}
    for i in range(tensors):
        t = torch.randn(rows, cols, generator=gen)
        out[f"model.layers.{i // 8}.block.{i % 8}.weight"] = t.to(device)
    return out


def make_shape_state(name: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of the named shape (bf16, random, generated on ``device``), in checkpoint order."""
    from ..testing.shapes import SHAPES, tensor_shapes

    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        n: torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        for n, shape in tensor_shapes(SHAPES[name], qwen3=False)
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from ..process import ProcessEngine
    from ..weights.manifest import specs_of
    from ..weights.session import connect_weight_sync

    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = args.transport in GPU_TRANSPORTS
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    state = make_shape_state(args.shape, device) if args.shape else make_state(args.size_mb, args.tensors, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    specs = [s.model_dump() for s in specs_of(list(state.items()))]
    result: dict[str, Any] = {
        "transport": args.transport, "bytes": nbytes, "tensors": len(state), "receivers": args.receivers,
        "bucket_mb": args.bucket_mb, "checksum": args.checksum, "threads": args.threads or torch.get_num_threads(),
    }
    if args.shape:
        result["shape"] = args.shape
    engines: list[EngineProtocol] = []
    servers = contextlib.ExitStack()
    if args.transport == "inproc":
        engines = [BenchReceiverEngine(EngineConfig(backend="bench-receiver", model="-", options={"specs": specs, "threads": args.threads}))]
    elif args.transport == "http":
        # One rollout-engines server per receiver (the remote plugin starts and stops them).
        from rollout_engines_remote.bench import http_receivers

        engines = servers.enter_context(http_receivers(specs, args.receivers, args.threads))
    else:
        result["receive_on"] = "thread" if args.receive_thread else "loop"
        for i in range(args.receivers):
            dev = f"cuda:{i % max(1, torch.cuda.device_count())}" if gpu else "cpu"
            if args.transport == "cuda_ipc":
                dev = "cuda:0"
            engines.append(ProcessEngine(
                EngineConfig(backend="bench-receiver", model="-", device=dev,
                             options={"specs": specs, "threads": args.threads,
                                      "receive_inline": not args.receive_thread}),
                factory="rollout_engines.bench.weight_sync:BenchReceiverEngine",
            ))
    options: dict[str, Any] = {"path": args.path} if args.transport == "disk" and args.path else {}
    if args.transport == "cuda_ipc" and args.no_direct:
        options["direct"] = False
    fraction = args.changed_fraction
    sent: list[int] = []
    try:
        sync = await connect_weight_sync(
            engines, args.transport, bucket_bytes=int(args.bucket_mb * 2**20) if args.bucket_mb else None,
            timeout_s=args.timeout,
            checksum=args.checksum, options=options, progress=False, delta=fraction is not None,
        )
        result["bucket_mb"] = sync.bucket_bytes / 2**20
        times, baselines, loops = [], [], []
        for version in range(args.repeats + 1):
            if fraction is not None and version:
                result["changed_elements"] = change_elements(state, fraction, seed=version)
            await sync.push(state, version=version + 1)
            times.append(sync.last_push_seconds)
            sent.append(sync.last_push_bytes)
            # The limit, measured between pushes, so both see the same machine (load changes).
            baselines.append(memcpy_gbps(nbytes, device, repeats=2))
            loops.append(python_loop_s())  # the host's Python speed, beside the baseline
        infos = [await e.info() for e in engines]
        send_timings = dict(sync.last_send_timings)
        await sync.close()
    finally:
        for e in engines:
            await e.close()
        servers.close()
    expected = sum(float(t.double().sum()) for t in state.values())
    verified = all(abs(i.extra["checksum"] - expected) <= 1e-6 * max(1.0, abs(expected)) for i in infos)
    if fraction is not None:
        from ..weights.delta import digest, fingerprint

        exact = digest({n: fingerprint(t) for n, t in state.items()})
        verified = verified and all(i.extra.get("digest") == exact for i in infos)
        result.update(changed_fraction=fraction, bytes_sent=sent[-1], full_push_bytes=sent[0],
                      bytes_sent_ratio=round(sent[-1] / nbytes, 4), bytes_sent_per_push=sent)
    opened = [i.extra.get("handles_opened") for i in infos]
    best = min(times[1:]) if len(times) > 1 else times[0]
    gbps = nbytes / best / 1e9
    baseline = max(baselines)
    result.update(
        seconds=round(best, 4), first_push_seconds=round(times[0], 4), gbps=round(gbps, 3),
        baseline=round(baseline, 3), baseline_kind="device-to-device copy" if gpu else "memcpy",
        ratio=round(gbps / baseline, 3), pushes=[round(t, 4) for t in times], verified=verified,
        host_loop_us=host_speed(loops),
    )
    if any(o is not None for o in opened):
        result["handles_opened"] = opened
    result["receiver_timings_last_push"] = infos[0].extra.get("timings") if infos else None
    result["sender_timings_last_push"] = send_timings
    if gpu:
        result["graph_replays"] = [i.extra.get("graph_replays") for i in infos]
        result["chunked_graphs"] = [i.extra.get("chunked_graphs") for i in infos]
    exporter = getattr(sync.sender, "_exporter", None)
    if args.transport == "cuda_ipc":
        result["direct"] = exporter is not None and exporter.failed is None
        if exporter is not None and exporter.failed:
            result["direct_unavailable"] = exporter.failed
    if args.transport == "gloo":
        raw = raw_gloo_broadcast_gbps(nbytes, args.receivers, args.repeats, args.threads)
        result.update(raw_broadcast_gbps=round(raw, 3), ratio_vs_raw=round(gbps / raw, 3))
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_run(args))


if __name__ == "__main__":
    import json

    parser = argparse.ArgumentParser(prog="python -m rollout_engines.bench.weight_sync")
    add_arguments(parser)
    parser.add_argument("--json", action="store_true")
    print(json.dumps(run(parser.parse_args())))
