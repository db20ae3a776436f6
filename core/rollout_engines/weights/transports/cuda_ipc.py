"""``cuda_ipc``: trainer and engine workers colocated on one GPU; buckets shared as CUDA IPC handles.

The same protocol as ``shm`` (see :mod:`._slots`), with device memory: the sender owns two bucket
buffers on its GPU, reused in turn, and shares each once as a CUDA IPC handle
(``torch.multiprocessing.reductions.reduce_tensor``, pickled to bytes) stored in the session's
TCPStore under the GPU's UUID. A receiver looks the handle up under *its* device's UUID (the
index of one GPU differs between processes with different ``CUDA_VISIBLE_DEVICES``; the UUID does
not), rebuilds it with its own device index, and keeps it open for every later bucket and update:
handles are opened once per slot, never per tensor or per bucket.

Ordering: the sender waits for its stream before it publishes a bucket (packing is asynchronous);
a receiver waits for its stream before it acknowledges one (its copies out of the slot must be
done before the sender packs the slot again).
"""

from __future__ import annotations

import pickle
from typing import Any, ClassVar

import torch

from ...errors import WeightSyncError
from ..manifest import TransportSpec
from ._slots import SlotReceiver, SlotSender
from ._store import TRAINER

#: Position of the device index in the argument tuple of ``rebuild_cuda_tensor``.
_DEVICE_ARG = 6


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device.index).uuid)


def _cuda_device(device: torch.device | str | None) -> torch.device:
    if not torch.cuda.is_available():
        raise WeightSyncError("cuda_ipc needs a CUDA device; use 'shm' to share buckets on the CPU")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        raise WeightSyncError(f"cuda_ipc works on CUDA devices, not {dev}; use 'shm' on the CPU")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


class CudaIpcSender(SlotSender):
    """Trainer half of ``cuda_ipc``: buckets live on the trainer's current CUDA device
    (``options['device']`` to choose another)."""

    name: ClassVar[str] = "cuda_ipc"

    def __init__(self, *, session_id: str, world_size: int, timeout_s: float, options: dict[str, Any]):
        self._device = _cuda_device(options.get("device"))
        self._uuid = device_uuid(self._device)
        super().__init__(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options)

    def device(self) -> torch.device:
        return self._device

    def _make_slot(self, name: str, nbytes: int) -> tuple[Any, torch.Tensor]:
        from torch.multiprocessing.reductions import reduce_tensor

        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        rebuild, args = reduce_tensor(tensor)
        self._kv.set(f"handle/{self._uuid}/{name}", pickle.dumps((rebuild, args)))  # type: ignore[arg-type]  # bytes are accepted
        return None, tensor

    def _free_slot(self, name: str, handle: Any) -> None:
        try:
            self._kv.delete_key(f"handle/{self._uuid}/{name}")
        except Exception:  # the store may be shutting down with us
            pass

    def _ready(self) -> dict[str, Any]:
        torch.cuda.current_stream(self._device).synchronize()
        return {"uuid": self._uuid}


class CudaIpcReceiver(SlotReceiver):
    """Engine-worker half of ``cuda_ipc``: opens the trainer's buffers on its own device."""

    name: ClassVar[str] = "cuda_ipc"

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cuda"):
        dev = _cuda_device(device)
        super().__init__(spec, rank=rank, device=dev)
        self._uuid = device_uuid(dev)
        self.opened = 0  # handles opened (once per slot); tests and benchmarks read it

    def _open_slot(self, name: str, info: dict[str, Any], index: int) -> tuple[Any, torch.Tensor]:
        key = f"handle/{self._uuid}/{name}"
        if not self._kv.check([key]):
            raise WeightSyncError(
                f"cuda_ipc: the trainer shares its buckets on GPU {info.get('uuid')}, this worker is on "
                f"{self._uuid}; colocate them on one GPU or use 'nccl' across GPUs", peer=TRAINER, bucket=index,
            )
        rebuild, args = pickle.loads(self._kv.get(key))
        args = list(args)
        args[_DEVICE_ARG] = self.device.index  # this process's index of that GPU
        tensor = rebuild(*args)
        self.opened += 1
        return None, tensor

    def _close_slot(self, name: str, handle: Any, trainer_gone: bool) -> None:
        return None  # dropping the tensor closes the handle

    def _before_ack(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
