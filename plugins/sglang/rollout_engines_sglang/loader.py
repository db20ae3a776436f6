"""SGLang's custom weight loader for relayed pushes: a bucket loaded by a copy plan.

SGLang's ``update_weights_from_tensor`` with ``load_format="flattened_bucket"`` rebuilds the
tensors and runs the model's ``load_weights``: per-tensor Python loaders on every push. SGLang
also calls a custom loader instead: a dotted path listed in its ``custom_weight_loader`` server
argument and sent as the ``load_format`` is imported in every TP rank and called as
``loader(model, named_tensors)`` (python/sglang/srt/model_executor/model_runner_components/
weight_updater.py, ``update_weights_from_tensor``; each rank deserializes only its own payload and
moves each tensor ``.to(device)``, a no-op for a CUDA IPC import of a buffer on its GPU).

:func:`load_bucket` is that loader. A payload is one ``(name, tensor)`` pair: the tensor is the
whole flat uint8 bucket and the *name* carries its layout, a compact JSON list (:func:`bucket_name`),
because a tensor name is a plain string that crosses SGLang's restricted unpickler as it is; no
class of ours is pickled. The loader rebuilds the views and applies them through a
:class:`~rollout_engines.weights.copy_plan.PlannedLoader`, one per model: the first push of a name
runs ``model.load_weights`` while recording where it lands, later pushes copy straight into the
parameters; names the plan cannot replay go through ``load_weights`` every time.

The relay stages every push into one buffer it keeps, so the same CUDA IPC buffer comes back push
after push. The loader keeps the last imports of it alive: torch's IPC cache then hands back the
same storage on the next push (no new mapping), and the views of a layout seen before are the same
objects, which the plan's copies replay as a CUDA graph. A bucket named :data:`FORGET` drops what
is kept for the model (the relay sends one before it frees its buffer, e.g. when the engine sleeps:
a kept import would hold that memory).

**Forwarded buckets** (``cuda_ipc`` with the trainer's tensors shared without packing): the relay
does not stage at all. It forwards the trainer's description of the memory a bucket lies in (the
segment handles and offsets of :mod:`rollout_engines.weights.transports._cuda_segments`) in a
tensor name (:func:`shared_name`; the payload's tensor is a one-byte token, not read), and the
loader opens those segments itself with the core's ``SegmentImporter``, one per model, and copies
straight from the trainer's memory into the parameters: one copy per push instead of two. Views
of segments the trainer keeps stay mapped and are the same objects push after push (the plan's
copies replay as a CUDA graph); segments it does not keep are unmapped once the bucket is loaded;
segments the trainer let go of come in the description's close list. A :data:`PROBE` entry (the
trainer's GPU) fails unless this rank is on that GPU and can open such memory: the relay asks once
before it forwards. :data:`FORGET_ALL` also unmaps the trainer's memory (the relay sends it when
its weight transfer closes).

**A doorbell** (the engine's option ``direct_receive``; ``shm`` and ``cuda_ipc``, one TP rank): a
:data:`DOOR_PREFIX` entry makes this process a receiver of the weight-sync session as the relay's
rank (a :class:`~rollout_engines.weights.receiver.WeightReceiver` over this model's copy plan) and
starts a :class:`~rollout_engines.weights.doorbell.DoorbellListener`, a thread on the session's
store. For an update it claimed the doorbell for, the engine rings that thread with the update's
manifest instead of receiving it in its relay: the thread reads the trainer's buckets itself (for
``cuda_ipc``, the trainer's own memory) and copies them into the parameters, as vLLM's workers do
when rung, with no hop through the relay or SGLang's ``update_weights_from_tensor`` (tokenizer
manager, scheduler queue, the answer back). The engine rings only while no request runs in SGLang
and lets none start until the thread answered; this module's lock keeps a load by SGLang's call and
one by the doorbell apart. :data:`FORGET_ALL` (or another door) stops the thread and closes its
receiver.

This module is imported inside SGLang's scheduler processes: keep it to torch and the core.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from rollout_engines.weights.buckets import torch_dtype, views_at
from rollout_engines.weights.copy_plan import CopyPlan, PlannedLoader
from rollout_engines.weights.doorbell import DoorbellListener
from rollout_engines.weights.manifest import TensorSpec, TransportSpec, WeightManifest, manifest_from_wire
from rollout_engines.weights.receiver import WeightReceiver
from rollout_engines.weights.transports._cuda_segments import SegmentImporter, available, steady
from rollout_engines.weights.transports.cuda_ipc import device_uuid

#: The ``load_format`` (and ``custom_weight_loader`` entry) naming :func:`load_bucket`.
LOADER = "rollout_engines_sglang.loader.load_bucket"
#: Start of a tensor name that carries a bucket's layout.
PREFIX = "rollout_engines.bucket:"
#: The tensor name that tells the loader to let go of the buffers it keeps (its tensor is ignored).
FORGET = "rollout_engines.forget"
#: Bucket imports kept per model at most (layouts of one buffer, e.g. a push in several buckets).
MAX_KEPT = 64
#: Start of a tensor name that carries a forwarded zero-copy bucket (see the module docstring).
SHARED_PREFIX = "rollout_engines.shared:"
#: Start of a tensor name that asks whether this rank can read the trainer's memory on the GPU
#: named after it (the load fails if not).
PROBE = "rollout_engines.probe:"
#: Like :data:`FORGET`, and also unmap the trainer's memory opened for forwarded buckets.
FORGET_ALL = "rollout_engines.forget_all"
#: Start of a tensor name that starts this rank's doorbell listener (:func:`door_name`).
DOOR_PREFIX = "rollout_engines.door:"


@dataclass(frozen=True)
class BucketEntry:
    """One tensor of a bucket: ``flat[start:end]`` viewed as ``dtype`` with ``shape``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def bucket_name(entries: Iterable[BucketEntry]) -> str:
    """The tensor name that carries ``entries`` (see the module docstring)."""
    rows = [[e.name, str(e.dtype).removeprefix("torch."), list(e.shape), e.start, e.end] for e in entries]
    return PREFIX + json.dumps(rows, separators=(",", ":"))


@functools.lru_cache(maxsize=64)
def parse_bucket_name(name: str) -> list[BucketEntry]:
    """The entries :func:`bucket_name` wrote into ``name`` (cached: every push of a layout sends the
    same name; do not mutate the list)."""
    if not name.startswith(PREFIX):
        raise ValueError(f"not a bucket name (it starts with {name[:40]!r}, not {PREFIX!r})")
    try:
        entries = [
            BucketEntry(str(n), torch_dtype(d), tuple(int(s) for s in shape), int(start), int(end))
            for n, d, shape, start, end in json.loads(name[len(PREFIX):])
        ]
        for e in entries:
            if e.start < 0 or any(s < 0 for s in e.shape) or e.end - e.start != math.prod(e.shape) * e.dtype.itemsize:
                raise ValueError(f"'{e.name}' spans bytes {e.start}-{e.end}, not its size as {e.dtype}{list(e.shape)}")
        return entries
    except (ValueError, TypeError) as exc:
        raise ValueError(f"malformed bucket layout in a tensor name: {exc}") from exc


class SharedBucket(NamedTuple):
    """A forwarded bucket: its index in the update (``bucket``), the trainer's GPU, the trainer's description
    of the memory it lies in (JSON, as the core's ``cuda_ipc`` published it) and its tensors."""

    bucket: int
    device_uuid: str
    description: str
    placements: tuple[TensorSpec, ...]


def shared_name(index: int, device_uuid: str, description: str, placements: Iterable[Any]) -> str:
    """The tensor name that carries a forwarded bucket (``placements``: the manifest's, with
    ``name``, ``dtype`` (a string) and ``shape``)."""
    rows = [[p.name, p.dtype, list(p.shape)] for p in placements]
    body = {"index": index, "uuid": device_uuid, "layout": rows, "description": description}
    return SHARED_PREFIX + json.dumps(body, separators=(",", ":"))


@functools.lru_cache(maxsize=64)
def parse_shared_name(name: str) -> SharedBucket:
    """The bucket :func:`shared_name` wrote into ``name`` (cached: a steady push sends the same
    names)."""
    if not name.startswith(SHARED_PREFIX):
        raise ValueError(f"not a forwarded bucket (the name starts with {name[:40]!r}, not {SHARED_PREFIX!r})")
    try:
        body = json.loads(name[len(SHARED_PREFIX):])
        placements = tuple(
            TensorSpec(name=n, dtype=d, shape=tuple(shape)) for n, d, shape in body["layout"]
        )
        index, uuid, description = body["index"], body["uuid"], body["description"]
        if type(index) is not int or not isinstance(uuid, str) or not isinstance(description, str):
            raise TypeError("index, uuid and description must be an integer and two strings")
        return SharedBucket(index, uuid, description, placements)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"malformed forwarded bucket in a tensor name: {exc}") from exc


def bucket_views(flat: torch.Tensor, entries: Sequence[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """Views of the flat uint8 ``flat``, one per entry (as SGLang's ``FlattenedTensorBucket``
    rebuilds them)."""
    return views_at(flat, ((e.name, e.dtype, e.shape, e.start) for e in entries))


#: One planned loader per model object; gone with the model (SGLang's object is left untouched).
_loaders: weakref.WeakKeyDictionary[Any, PlannedLoader] = weakref.WeakKeyDictionary()


#: Per model: (storage address, offset, size, layout name) -> (the bucket tensor, its views).
_kept: weakref.WeakKeyDictionary[Any, dict[tuple[int, int, int, str], tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class _Forwarded:
    """One model's side of forwarded buckets."""

    #: Maps the trainer's memory (once per allocation).
    importer: SegmentImporter
    #: Per forwarded bucket name: the importer's ``closed`` count then (a close since makes them
    #: stale) and the named views built for it.
    views: dict[str, tuple[int, list[tuple[str, torch.Tensor]]]] = field(default_factory=dict)
    #: The last payload's token tensor, kept so that torch's CUDA IPC cache hands back the same
    #: storage next time (the relay sends the same token every push).
    token: torch.Tensor | None = None


_forwarded: weakref.WeakKeyDictionary[Any, _Forwarded] = weakref.WeakKeyDictionary()


def _state(model: Any) -> _Forwarded:
    state = _forwarded.get(model)
    if state is None:
        state = _forwarded[model] = _Forwarded(SegmentImporter(torch.device("cuda", torch.cuda.current_device())))
    return state


def _on_trainers_gpu(device: Any, wanted: str | None, what: str) -> None:
    """Raise unless this process can open the trainer's CUDA memory on GPU ``wanted`` (``device``: a
    callable giving this process's device, called only where cuda-bindings are there)."""
    if not available():
        raise RuntimeError(f"{what} need cuda-bindings in SGLang's processes")
    here = device_uuid(device())
    if here != wanted:
        raise RuntimeError(f"this SGLang rank is on GPU {here}, the trainer's tensors on {wanted}")


def probe(model: Any, name: str) -> None:
    """Raise unless this rank can open the trainer's memory on the GPU ``name`` names."""
    try:
        _on_trainers_gpu(lambda: _state(model).importer.device, name[len(PROBE):], "forwarded buckets")
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; relaying by staging") from None


def shared_views(model: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    """Views of a forwarded bucket on the trainer's memory: the ones built before where the same
    bucket comes again in segments still mapped, else new ones (opening segments not yet mapped)."""
    state = _state(model)
    importer, cache = state.importer, state.views
    hit = cache.get(name)
    if hit is not None and hit[0] == importer.closed:
        return hit[1]
    bucket = parse_shared_name(name)
    importer.begin()
    desc = json.loads(bucket.description)
    named = [(p.name, v) for p, v in zip(bucket.placements, importer.views(desc, bucket.placements), strict=True)]
    if steady(desc):
        if len(cache) >= MAX_KEPT:
            cache.clear()
        cache[name] = (importer.closed, named)
    return named


def door_name(spec_json: str, door: str, rank: int, device_uuid: str | None = None) -> str:
    """The tensor name that starts a doorbell listener: the weight transfer's spec (JSON, with its
    store's address and secret), the door's name, the relay's rank in the session and, for
    ``cuda_ipc``, the GPU the trainer's memory is on (the relay's: its own receive checked that)."""
    return DOOR_PREFIX + json.dumps({"spec": spec_json, "door": door, "rank": rank, "uuid": device_uuid},
                                    separators=(",", ":"))


#: The transports whose updates this process can receive itself, as the relay's rank: they signal
#: through the session's store only (a process group's rank cannot be taken twice).
DOOR_TRANSPORTS = ("shm", "cuda_ipc")
#: Held by every load, whether SGLang called the loader or the doorbell's thread did.
_lock = threading.Lock()


class _ModelTarget:
    """The doorbell receiver's :class:`~rollout_engines.weights.receiver.WeightTarget`: the model,
    loaded through its copy plan as :func:`load_bucket` loads it. The engine checked the update
    against the model's names, shapes and dtypes before it rang (it knows the checkpoint's names,
    this process only the model's parameters), so it is taken here as the manifest describes it."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._tensors: Any = None
        self._specs: dict[str, TensorSpec] = {}

    def select(self, manifest: WeightManifest) -> None:
        if manifest.tensors is not self._tensors:  # a steady push shares its layout's lists
            self._tensors, self._specs = manifest.tensors, {t.name: t for t in manifest.tensors}

    def expected_specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def apply(self, named: Sequence[tuple[str, torch.Tensor]], *, owned: bool) -> None:
        _apply_planned(self.model, list(named), owned=owned)


@dataclass
class _Door:
    """A model's doorbell: the listener thread and the session receiver it runs for each ring."""

    listener: DoorbellListener
    receiver: WeightReceiver  # its target: a _ModelTarget

    def close(self) -> None:
        self.listener.close()  # a receive in progress finishes first
        self.receiver.close()


#: One doorbell per model (while its weight transfer is open).
_doors: weakref.WeakKeyDictionary[Any, _Door] = weakref.WeakKeyDictionary()


def stop_door(model: Any) -> None:
    """Stop the doorbell of ``model`` and close its receiver (no-op without one)."""
    door = _doors.pop(model, None)
    if door is not None:
        door.close()


def start_door(model: Any, name: str) -> None:
    """Start a doorbell for ``model`` as ``name`` (:func:`door_name`) says, replacing one started
    before: a receiver of the weight-sync session as the relay's rank, and a listener thread that
    runs it for each ring. Both joined the session's store before this returns (the engine may
    ring next). Raises where this process cannot receive the transfer's updates itself."""
    try:
        body = json.loads(name[len(DOOR_PREFIX):])
        spec = TransportSpec.model_validate_json(body["spec"])
        door, rank, uuid = body["door"], body["rank"], body.get("uuid")
        if not isinstance(door, str) or type(rank) is not int or not isinstance(uuid, str | None):
            raise TypeError("door, rank and uuid must be a string, an integer and a string or null")
    except (ValueError, TypeError, KeyError) as exc:
        # Not the error's text: SGLang logs a loader's error, and a spec's carries its input (the
        # session's secret).
        raise ValueError(f"malformed doorbell entry in a tensor name ({type(exc).__name__})") from None
    stop_door(model)
    if spec.transport not in DOOR_TRANSPORTS:
        raise ValueError(f"no doorbell for '{spec.transport}' pushes: only {', '.join(DOOR_TRANSPORTS)} updates can be "
                         "received here as the relay's rank")
    cuda = torch.cuda.is_available()
    index = torch.cuda.current_device() if cuda else None
    device: torch.device | str = "cpu"
    if spec.transport == "cuda_ipc":
        if index is None:
            raise RuntimeError("a cuda_ipc doorbell needs CUDA in SGLang's processes")
        device = torch.device("cuda", index)
        _on_trainers_gpu(lambda: device, uuid, "cuda_ipc doorbells")

    def setup() -> None:  # the CUDA device is per thread
        if index is not None:
            torch.cuda.set_device(index)

    target = _ModelTarget(model)
    receiver = WeightReceiver(target, device=device, mode="inplace", label="sglang scheduler")  # type: ignore[arg-type]
    receiver.connect(spec, local_rank=rank - spec.rank_offset)
    try:
        listener = DoorbellListener(spec, door, rank=rank, receive=functools.partial(_door_receive, model),
                                    lock=_lock, setup=setup)
    except BaseException:
        receiver.close()
        raise
    _doors[model] = _Door(listener, receiver)


def _door_receive(model: Any, wire: dict[str, Any]) -> dict[str, Any]:
    """What the doorbell's thread runs (under :data:`_lock`): receive the update ``wire`` names
    (:func:`~rollout_engines.weights.manifest.manifest_to_wire`'s form) straight from the trainer
    into ``model``."""
    woke = time.time()
    door = _doors.get(model)
    if door is None:
        raise RuntimeError("the doorbell of this model was stopped")
    manifest = manifest_from_wire(wire)
    target = door.receiver.target
    assert isinstance(target, _ModelTarget)
    target.select(manifest)
    with torch.no_grad():  # grad mode is per thread; SGLang loads under no_grad
        version = door.receiver.receive(manifest)
    if torch.cuda.is_available():
        # SGLang's forward runs on its own streams: the copies are done before the engine answers.
        torch.cuda.current_stream().synchronize()
    # Where a ring's time went (the engine reports medians): from the engine's write to this thread
    # running (wall clocks of one machine), and the receive's own account.
    sent = wire.get("sent")
    return {"ok": True, "version": version, "timings": door.receiver.last_timings,
            "wake_s": woke - sent if isinstance(sent, float) else None, "answered": time.time()}


def _apply_planned(model: Any, named: list[tuple[str, torch.Tensor]], *, owned: bool) -> None:
    """Load ``named`` into ``model`` through its copy plan (``load_weights`` where it cannot replay)."""
    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        model.load_weights(items)

    planned_loader(model).apply(named, load, owned=owned)


def planned_loader(model: Any) -> PlannedLoader:
    """The :class:`PlannedLoader` of ``model`` (created on first use)."""
    loader = _loaders.get(model)
    if loader is None:
        loader = _loaders[model] = PlannedLoader(CopyPlan())
    return loader


def kept_views(model: Any, flat: torch.Tensor, name: str) -> list[tuple[str, torch.Tensor]]:
    """The views of bucket ``flat`` laid out as ``name`` says: the ones built before where ``flat``
    is the buffer of an earlier push (kept alive here, so its import is the same storage), else
    new ones, kept for the next push."""
    kept = _kept.setdefault(model, {})
    key = (flat.untyped_storage().data_ptr(), int(flat.storage_offset()), flat.numel(), name)
    hit = kept.get(key)
    if hit is not None:
        return hit[1]
    views = bucket_views(flat, parse_bucket_name(name))
    if len(kept) >= MAX_KEPT:
        forget(model)
        kept = _kept.setdefault(model, {})
    kept[key] = (flat, views)
    return views


def forget(model: Any, *, shared: bool = False) -> None:
    """Let go of every bucket import kept for ``model`` (and the copy plan's views of them);
    ``shared``: also unmap the trainer's memory opened for forwarded buckets."""
    _kept.pop(model, None)
    loader = _loaders.get(model)
    if loader is not None:
        loader.forget_sources()
    state = _forwarded.pop(model, None) if shared else None
    if state is not None:
        state.importer.close()


def load_bucket(model: Any, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader (``load_format=LOADER``): load the buckets in ``named_tensors``
    (and any plain named tensors) into ``model``; a :data:`FORGET` entry drops what is kept, a
    :data:`DOOR_PREFIX` entry starts a doorbell listener, :data:`FORGET_ALL` also stops it."""
    for name, _ in named_tensors:  # outside the lock: stopping waits for a ring in progress
        if name == FORGET_ALL:
            stop_door(model)
        elif name.startswith(DOOR_PREFIX):
            start_door(model, name)
    named_tensors = [(n, t) for n, t in named_tensors if not n.startswith(DOOR_PREFIX)]
    if not named_tensors:
        return
    with _lock:
        _load(model, named_tensors)


def _load(model: Any, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    named: list[tuple[str, torch.Tensor]] = []
    forwarded = False
    for name, tensor in named_tensors:
        if name == FORGET or name == FORGET_ALL:
            forget(model, shared=name == FORGET_ALL)
        elif name.startswith(PREFIX):
            named += kept_views(model, tensor, name)
        elif name.startswith(SHARED_PREFIX):
            forwarded = True
            named += shared_views(model, name)
            _state(model).token = tensor
        elif name.startswith(PROBE):
            probe(model, name)
            _state(model).token = tensor
        else:
            named.append((name, tensor))
    if not named:
        return

    # Not owned: the views are of the sender's staging buffer, which it refills once SGLang answers.
    _apply_planned(model, named, owned=False)
    # SGLang answers without waiting for the GPU; the copies must be done before the sender reuses
    # its buffer (load_weights' Python loop hid this, direct copies return at once).
    devices = {t.device for _, t in named if t.is_cuda}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    if forwarded:
        _state(model).importer.finish()  # segments the trainer does not keep: unmapped now
