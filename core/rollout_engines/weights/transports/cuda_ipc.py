"""``cuda_ipc``: trainer and engine workers colocated on one GPU; buckets shared as CUDA IPC handles.

The same protocol as ``shm`` (see :mod:`._slots`), with device memory: the sender owns two bucket
buffers on its GPU, reused in turn, and shares each once as a CUDA IPC handle
(the fields of ``torch.multiprocessing.reductions.reduce_tensor``'s answer as plain JSON, base64
for the handle bytes; never a pickle) stored, signed, in the session's TCPStore under the GPU's UUID. A receiver looks the handle up under *its* device's UUID (the
index of one GPU differs between processes with different ``CUDA_VISIBLE_DEVICES``; the UUID does
not), rebuilds it with its own device index, and keeps it open for every later bucket and update:
handles are opened once per slot, never per tensor or per bucket.

Zero-copy (the default where possible, ``options={'direct': False}`` to turn it off): when the
bucket's tensors are ordinary allocations on the trainer's GPU, nothing is packed; the receiver
maps the allocations that hold them and copies straight out of the trainer's memory (one copy
instead of two; see :mod:`._cuda_segments`). Otherwise the bucket goes through the slots above.

A host that hands buckets on to another process of its own (SGLang's relay, whose scheduler
processes load the weights) can forward a zero-copy bucket instead of copying it: its views come
as :class:`SharedViews`, which carry the trainer's description, and that process opens the same
segments with its own :class:`~._cuda_segments.SegmentImporter` (see ``WeightTarget.apply_shared``
in :mod:`rollout_engines.weights.receiver`).

Ordering: the sender waits for its stream before it publishes a bucket (packing is asynchronous);
a receiver waits for its stream before it acknowledges one (its copies out of the slot must be
done before the sender packs the slot again, or before the trainer changes its tensors).
"""

from __future__ import annotations

import base64
import json
import os
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ...errors import WeightSyncError
from ..buckets import BucketHeader
from ..manifest import TransportSpec, WeightManifest
from ..recent import Recent
from ._cuda_segments import DESCRIBED_SETS, SegmentExporter, SegmentImporter
from ._slots import SlotReceiver, SlotSender
from ._store import TRAINER

#: Slots made by senders in this process, by name: CUDA refuses to open a process's own IPC
#: handle, so an engine hosted beside the trainer reads the slot itself.
_LOCAL_SLOTS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device.index).uuid)


def _cuda_device(device: torch.device | str | None) -> torch.device:
    if not torch.cuda.is_available():
        raise WeightSyncError("cuda_ipc needs a CUDA device; use 'shm' to share buckets on the CPU")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        raise WeightSyncError(f"cuda_ipc works on CUDA devices, not {dev}; use 'shm' on the CPU")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _unb64(value: Any, field: str) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise WeightSyncError(f"cuda_ipc: handle field '{field}' is not a base64 string", peer=TRAINER)
    return base64.b64decode(value, validate=True)


def handle_to_json(args: Sequence[Any]) -> str:
    """The fields of ``reduce_tensor``'s rebuild arguments for a flat uint8 CUDA buffer, as JSON."""
    (_, size, stride, offset, _, dtype, _, handle, storage_size, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    if dtype != torch.uint8 or len(size) != 1:
        raise WeightSyncError("cuda_ipc: slots are flat uint8 buffers")
    return json.dumps({
        "size": int(size[0]), "stride": int(stride[0]), "offset": int(offset), "handle": _b64(handle),
        "storage_size": int(storage_size), "storage_offset": int(storage_offset), "ref_handle": _b64(ref_handle),
        "ref_offset": int(ref_offset), "event_handle": _b64(event_handle), "event_sync": bool(event_sync),
    })


def handle_from_json(data: bytes, device_index: int) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor``'s arguments from :func:`handle_to_json`'s text: types checked, the
    tensor and storage classes and the dtype fixed here (nothing named by the peer is imported)."""
    try:
        d = json.loads(data)
        ints = {k: d[k] for k in ("size", "stride", "offset", "storage_size", "storage_offset", "ref_offset")}
        if not all(type(v) is int and v >= 0 for v in ints.values()) or type(d["event_sync"]) is not bool:
            raise ValueError("sizes and offsets must be non-negative integers")
        return (
            torch.Tensor, (ints["size"],), (ints["stride"],), ints["offset"], torch.storage.TypedStorage,
            torch.uint8, device_index, _unb64(d["handle"], "handle"), ints["storage_size"],
            ints["storage_offset"], False, _unb64(d["ref_handle"], "ref_handle"), ints["ref_offset"],
            _unb64(d["event_handle"], "event_handle"), d["event_sync"],
        )
    except WeightSyncError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightSyncError(f"cuda_ipc: malformed buffer handle from the trainer: {exc}", peer=TRAINER) from exc


class SharedViews(list[torch.Tensor]):
    """A zero-copy bucket as a receiver gets it: one view per placement on the trainer's memory,
    plus the trainer's description of that memory (JSON, as published; :meth:`SegmentImporter.views_of`
    reads it), so a host can forward it to another process on the same GPU instead of copying."""

    def __init__(self, views: Sequence[torch.Tensor], description: str, device_uuid: str) -> None:
        super().__init__(views)
        self.description = description
        self.device_uuid = device_uuid


class CudaIpcSender(SlotSender):
    """Trainer half of ``cuda_ipc``: buckets live on the trainer's current CUDA device
    (``options['device']`` to choose another)."""

    name: ClassVar[str] = "cuda_ipc"

    def __init__(self, *, session_id: str, world_size: int, timeout_s: float, options: dict[str, Any]):
        self._device = _cuda_device(options.get("device"))
        self._uuid = device_uuid(self._device)
        super().__init__(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options)
        self._exporter = SegmentExporter(self._device) if options.get("direct", True) else None
        self._held: dict[int, Sequence[torch.Tensor]] = {}
        #: Per bucket: the last zero-copy descriptions (most recent first), each with its JSON and
        #: whether the trainer keeps all of it.
        self._serialized: dict[int, Recent[tuple[Any, str, bool]]] = {}

    # -- zero-copy buckets --
    def share_tensors(self, index: int, tensors: Sequence[torch.Tensor]) -> Any | None:
        return self._exporter.describe(index, tensors) if self._exporter is not None else None

    def send_shared(self, header: BucketHeader, shared: Any, tensors: Sequence[torch.Tensor]) -> None:
        self._held[header.index] = tensors  # alive until every receiver copied them
        # Tensors the trainer keeps anyway need no acknowledgement before the push ends; holding
        # temporaries (e.g. gathered shards) for receivers is bounded to two buckets, as slots are.
        known = self._serialized.setdefault(header.index, Recent(DESCRIBED_SETS))
        cached = known.find(lambda c: c[0] is shared)  # a steady push reuses its descriptions
        if cached is None:
            cached = known.add((shared, json.dumps(shared), all(s[2] for s in shared["segments"])))
        self._publish(header, ack=not cached[2], raw=cached[1])

    def _final_ack_needed(self) -> bool:
        return self._exporter is not None and self._exporter.unmapping()

    def _acked(self, index: int) -> None:
        self._held.pop(index, None)
        if self._exporter is not None:
            self._exporter.acked(index)

    def begin(self, manifest: WeightManifest) -> None:
        super().begin(manifest)
        self._held.clear()
        if self._exporter is not None:
            self._exporter.begin_push()

    def end(self, manifest: WeightManifest) -> None:
        super().end(manifest)
        if self._exporter is not None:
            self._exporter.end_push()

    def close(self) -> None:
        super().close()
        self._held.clear()
        self._serialized.clear()
        if self._exporter is not None:
            self._exporter.close()

    def device(self) -> torch.device:
        return self._device

    def _make_slot(self, name: str, nbytes: int) -> tuple[Any, torch.Tensor]:
        from torch.multiprocessing.reductions import reduce_tensor

        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        _LOCAL_SLOTS[name] = tensor
        # Only the arguments travel, not the rebuild function: a library in this process may have
        # patched torch's reductions (SGLang does) with functions a receiver cannot import.
        self._kv.set(f"handle/{self._uuid}/{name}", handle_to_json(reduce_tensor(tensor)[1]))
        return None, tensor

    def _free_slot(self, name: str, handle: Any) -> None:
        _LOCAL_SLOTS.pop(name, None)
        try:
            self._kv.delete_key(f"handle/{self._uuid}/{name}")
        except Exception:  # the store may be shutting down with us
            pass

    def _ready(self) -> dict[str, Any]:
        torch.cuda.current_stream(self._device).synchronize()
        return {"uuid": self._uuid, "pid": os.getpid()}


class CudaIpcReceiver(SlotReceiver):
    """Engine-worker half of ``cuda_ipc``: opens the trainer's buffers on its own device."""

    name: ClassVar[str] = "cuda_ipc"

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cuda"):
        dev = _cuda_device(device)
        super().__init__(spec, rank=rank, device=dev)
        self._uuid = device_uuid(dev)
        self.slots_opened = 0  # handles opened (once per slot)
        self._segments = SegmentImporter(dev)

    @property
    def opened(self) -> int:
        """IPC handles opened so far (slots, and the trainer's segments); tests and benchmarks read it."""
        return self.slots_opened + self._segments.opened

    def begin(self, manifest: WeightManifest) -> None:
        super().begin(manifest)
        self._segments.begin()

    def _open_shared(self, info: dict[str, Any], index: int) -> list[torch.Tensor]:
        if info.get("uuid") != self._uuid:
            raise WeightSyncError(
                f"cuda_ipc: the trainer's tensors are on GPU {info.get('uuid')}, this worker is on "
                f"{self._uuid}; colocate them on one GPU or use 'nccl' across GPUs", peer=TRAINER, bucket=index,
            )
        manifest = self._manifest
        assert manifest is not None
        views = self._segments.views_of(info["raw"], index, manifest.tensors, lambda: manifest.bucket_tensors(index))
        return SharedViews(views, info["raw"], self._uuid)

    def _last_release(self) -> None:
        self._segments.finish()

    def _after_detach(self, trainer_gone: bool, names: list[str]) -> None:
        self._segments.close()

    def _open_slot(self, name: str, info: dict[str, Any], index: int) -> tuple[Any, torch.Tensor]:
        key = f"handle/{self._uuid}/{name}"
        if not self._kv.check([key]):
            raise WeightSyncError(
                f"cuda_ipc: the trainer shares its buckets on GPU {info.get('uuid')}, this worker is on "
                f"{self._uuid}; colocate them on one GPU or use 'nccl' across GPUs", peer=TRAINER, bucket=index,
            )
        local = _LOCAL_SLOTS.get(name) if info.get("pid") == os.getpid() else None
        if local is not None:
            return None, local  # the trainer is this process: no handle to open
        from torch.multiprocessing import reductions

        args = handle_from_json(self._kv.get(key), self.device.index)  # this process's index of that GPU
        # torch's own rebuild, also where a library patched it (SGLang keeps the original aside).
        rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
        try:
            tensor = rebuild(*args)
        except RuntimeError as exc:
            raise WeightSyncError(
                f"cuda_ipc: could not open the trainer's bucket buffer on {self.device}: {exc}", peer=TRAINER, bucket=index
            ) from exc
        self.slots_opened += 1
        return None, tensor

    def _close_slot(self, name: str, handle: Any, trainer_gone: bool) -> None:
        return None  # dropping the tensor closes the handle

    def _before_ack(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
