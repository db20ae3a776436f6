"""What the benchmarks share: reading their arguments, engine options, and (for the ones that push
weights) the weights to push and the check that a push landed."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..options import add_option_argument, merge_options

if TYPE_CHECKING:
    from ..weights.manifest import ChecksumKind

#: The prefix of ``--option`` keys that go to the weight transport instead of the engine.
TRANSPORT_PREFIX = "transport."


def p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def check_seconds(value: float, flag: str) -> float:
    """A value of ``flag`` (seconds of an untimed pause): refuse a negative one or NaN."""
    if not value >= 0:  # NaN too
        raise ValueError(f"{flag} must be >= 0, got {value}")
    return value


def pause_seconds(args: Any, name: str) -> float:
    """The pause ``args.name`` (e.g. ``idle_s``, the flag ``--idle-s``) in seconds, 0 when unset;
    refused as :func:`check_seconds` does."""
    return check_seconds(float(arg(args, name, 0.0)), "--" + name.replace("_", "-"))


def seconds_type(flag: str) -> Callable[[str], float]:
    """An argparse ``type`` for ``flag`` (seconds of an untimed pause): a bad value is a usage
    error (exit status 2)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} wants seconds, got {text!r}") from None
        try:
            return check_seconds(value, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


#: ``--idle-s`` as argparse reads it.
idle_seconds = seconds_type("--idle-s")


def arg(args: Any, name: str, default: Any) -> Any:
    """``args.name`` (an argparse namespace) or ``args[name]`` (a dict), ``default`` when unset."""
    value = args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)
    return default if value is None else value


def parse_options(args: Any) -> dict[str, Any]:
    """The engine options of a benchmark's arguments: an ``options`` dict updated by the
    ``--option`` items (pairs from the command line, or ``"K=V"`` strings in a dict)."""
    return merge_options(arg(args, "option", []), base=arg(args, "options", {}))


def split_transport_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(engine options, weight-transport options)``: ``transport.K`` keys go to the transport as ``K``."""
    engine = {k: v for k, v in options.items() if not k.startswith(TRANSPORT_PREFIX)}
    transport = {k.removeprefix(TRANSPORT_PREFIX): v for k, v in options.items() if k.startswith(TRANSPORT_PREFIX)}
    return engine, transport


def model_path(args: Any) -> str:
    """``--model``, or the tiny test model's directory (built on first use)."""
    model = arg(args, "model", None)
    if model is not None:
        return str(model)
    from ..testing.tiny_model import tiny_model_path

    return str(tiny_model_path())


#: Untimed pushes before a push benchmark's timed ones (``--warmup``): each of the two weight sets
#: is pushed twice, so every timed push finds it known (mapped, described, copy graphs captured).
WARMUP_PUSHES = 4


def add_push_arguments(parser: argparse.ArgumentParser, *, checksum: str) -> None:
    """The arguments of the benchmarks that push weights into one engine (``push``, ``refit``)."""
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    parser.add_argument("--transport", default=None, help="default: cuda_ipc on a GPU, shm on the CPU")
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--checksum", default=checksum, choices=["pos64", "sum64", "none"], help="per-bucket checksum")
    parser.add_argument("--warmup", type=int, default=WARMUP_PUSHES,
                        help="untimed pushes first, alternating the two weight sets as the timed ones do: the "
                        "sender learns that the trainer keeps both (zero-copy cuda_ipc maps them for good from "
                        "their second push) and the engine captures its copies; 0 times from the first push")
    parser.add_argument("--one-set", action="store_true",
                        help="the trainer holds one set of weights and rewrites it before each push (untimed, from "
                        "host memory), as an optimizer step does, instead of keeping two sets on its device: for a "
                        "model whose two sets do not fit beside the engine")
    add_option_argument(parser, help="engine option; 'transport.K=V' sets a weight-transport option")


@dataclass
class PushBench:
    """The settings every push benchmark reads from its arguments, and the engine it started."""

    backend: str
    model: str
    bucket_bytes: int
    checksum: ChecksumKind
    options: dict[str, Any]  #: the engine's
    transport_options: dict[str, Any]
    engine: Any

    @classmethod
    def start(cls, args: Any, *, checksum: ChecksumKind) -> PushBench:
        """Read ``--backend``, ``--model``, ``--bucket-mb``, ``--checksum`` (default ``checksum``) and
        ``--option``, then create the engine (close it with ``engine.close()``)."""
        from ..factory import create_engine

        backend = arg(args, "backend", "vllm")
        model = model_path(args)
        options, transport_options = split_transport_options(parse_options(args))
        engine = create_engine(backend, model=model, **options)
        return cls(backend=backend, model=model, bucket_bytes=int(float(arg(args, "bucket_mb", 512)) * 2**20),
                   checksum=arg(args, "checksum", checksum), options=options, transport_options=transport_options,
                   engine=engine)


@dataclass
class PushWeights:
    """Where a push benchmark runs and the two weight sets it alternates between.

    With one set (``one_set``) the trainer holds one set of tensors, ``live``, and rewrites it
    before each push (:meth:`use`) from ``original`` or ``changed``, both then in host memory, as
    an optimizer step rewrites a trainer's parameters in place: a model whose two sets do not fit
    beside the engine on one GPU (the 14B shape on an 80 GB GPU) is pushed from one set."""

    gpu: bool
    transport: str
    device: str  #: where the trainer side holds the weights ("cuda" for cuda_ipc and nccl)
    original: dict[str, Any]
    changed: dict[str, Any]
    live: dict[str, Any] | None = None  #: the one set pushed, with ``one_set``

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.original.values())

    def use(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """What to push for ``tensors`` (``original`` or ``changed``): themselves, or with one set
        the live tensors rewritten to their values (the copy is done when this returns)."""
        if self.live is None:
            return tensors
        import torch

        for name, t in self.live.items():
            t.copy_(tensors[name], non_blocking=True)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return self.live


async def push_weights(engine: Any, model: str, transport: str | None, *, one_set: bool = False) -> PushWeights:
    """The engine's own weights and a perturbed copy, in its dtype, on the device ``transport``
    sends from (default: cuda_ipc on a GPU, shm on the CPU); with ``one_set``, both in host
    memory (pinned for a GPU) and one set on the device to push from (see :class:`PushWeights`)."""
    import torch

    from ..weights.checkpoint import load_checkpoint, perturbed

    facts = await engine.diagnostics()
    gpu = (facts.platform or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    transport = transport or ("cuda_ipc" if gpu else "shm")
    dtype_name = facts.weights_dtype or (engine.config.dtype if engine.config.dtype != "auto" else None)
    dtype = None
    if dtype_name is not None:
        from ..weights.buckets import torch_dtype

        dtype = torch_dtype(dtype_name.removeprefix("torch."))
    device = "cuda" if transport in ("cuda_ipc", "nccl") else "cpu"
    loaded = load_checkpoint(model, dtype=dtype)
    if not one_set:
        original = {k: v.to(device) for k, v in loaded.items()}
        changed = perturbed(original)  # on the device: the CPU would take minutes for a 14B shape
        return PushWeights(gpu=gpu, transport=transport, device=device, original=original, changed=changed)

    def host(t: Any) -> Any:
        t = t.to("cpu")
        return t.pin_memory() if device == "cuda" else t

    live = {}
    for name in list(loaded):  # one tensor at a time: the host never holds the checkpoint twice
        live[name] = loaded[name].to(device, copy=True)
        loaded[name] = host(loaded.pop(name))
    changed = perturbed(live, place=host)  # drawn on the device, kept in host memory
    if device == "cuda":
        torch.cuda.empty_cache()  # the noise's blocks: the engine beside it may need that room
    return PushWeights(gpu=gpu, transport=transport, device=device, original=loaded, changed=changed, live=live)


class Fingerprint:
    """What tells one set of weights from another: the engine's weights fingerprint
    (``diagnostics(fingerprint=True)``) where it makes one, else its greedy tokens for ``probe``."""

    def __init__(self, engine: Any, probe: Any) -> None:
        self.engine, self.probe = engine, probe
        self.own = False  #: whether the engine made the last fingerprint itself

    async def __call__(self) -> Any:
        weights = (await self.engine.diagnostics(fingerprint=True)).weights_fingerprint
        self.own = weights is not None
        if self.own:
            return weights
        return [c.token_ids for c in await self.engine.generate(self.probe)]

    @property
    def kind(self) -> str:
        return "weights" if self.own else "greedy tokens"


def memcpy_gbps(nbytes: int, device: Any, repeats: int = 5, chunk_bytes: int = 1 << 30) -> float:
    """Copy bandwidth on ``device`` (GB/s, best of ``repeats``): ``nbytes`` copied between two
    buffers, at most ``chunk_bytes`` each (a 30 GB state is measured without 60 GB of buffers;
    copies of 1 GiB run at the device's full bandwidth)."""
    import torch

    device = torch.device(device)
    size = max(1, min(nbytes, chunk_bytes))
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.zeros(size, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        left = nbytes
        while left > 0:
            n = min(left, size)
            dst[:n].copy_(src[:n])
            left -= n
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return nbytes / best / 1e9


def python_loop_s(n: int = 20000) -> float:
    """Seconds for one small pure-Python loop: how fast the host runs Python right now."""
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += i
    return time.perf_counter() - start


def host_speed(samples: list[float]) -> dict[str, float]:
    """``python_loop_s`` samples taken during a run, in microseconds (median, fastest, slowest): a
    run's CPU-bound phases (Python, thread hand-offs) move with them, so two runs' figures compare
    best where these agree (``benchmarks/cpu_drift.py`` shows the host's drift on its own)."""
    if not samples:
        return {}
    us = [s * 1e6 for s in samples]
    return {"median": round(statistics.median(us), 1), "min": round(min(us), 1), "max": round(max(us), 1)}
