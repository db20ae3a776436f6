"""``shm``: two shared-memory slots on one host, reused in turn; signals through the TCPStore.

The CPU analogue of ``cuda_ipc`` (protocol in :mod:`._slots`): the slots are
``multiprocessing.shared_memory`` segments that every receiver maps once.

Receivers copy out (``keeps_buffer = False``). The sender unlinks its segments on close and after
a failed update (new segments are made for the next one); receivers detach from them on close,
on failure, and unlink them if the trainer died (a killed trainer cannot).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from multiprocessing import shared_memory
from typing import Any, ClassVar

import torch

from ...errors import WeightSyncError
from ..manifest import TransportSpec
from ._slots import SlotReceiver, SlotSender, slot_name, slot_number
from ._store import TRAINER

logger = logging.getLogger("rollout_engines.weights")

#: Where the system lists shared-memory segments as files (Linux).
_SHM_DIR = "/dev/shm"


class _Attached:
    """A segment another process created, mapped without ``SharedMemory`` (which, before Python
    3.13, registers it with this process's resource tracker, whose exit would unlink the
    trainer's segment, and whose bookkeeping spawned children share with their parent)."""

    def __init__(self, name: str) -> None:
        import _posixshmem

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            self.buf = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name = name

    def close(self) -> None:
        self.buf.close()

    def unlink(self) -> None:
        self.unlink_name(self.name)

    @staticmethod
    def unlink_name(name: str) -> None:
        import _posixshmem

        _posixshmem.shm_unlink("/" + name)


def _view(seg: shared_memory.SharedMemory | _Attached, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)


def _close(seg: shared_memory.SharedMemory | _Attached, unlink: bool) -> None:
    try:
        seg.close()
    except BufferError:
        pass  # a tensor still views it; the mapping goes when that tensor does
    if unlink:
        try:
            seg.unlink()
        except FileNotFoundError:
            pass


class ShmSender(SlotSender):
    """Trainer half of ``shm``."""

    name: ClassVar[str] = "shm"
    #: Buckets that fit in a server's last-level cache: the checksum pass after packing, and the
    #: receiver's copy after its checksum, read from cache instead of memory (1 GiB / 320 tensors
    #: on a 2-core machine: 16-32 MiB pushes 10-20% faster than 256 MiB; benchmarks/RESULTS.md).
    default_bucket_bytes: ClassVar[int | None] = 16 * 2**20

    def _make_slot(self, name: str, nbytes: int) -> tuple[Any, torch.Tensor]:
        seg = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        return seg, _view(seg, nbytes)

    def _free_slot(self, name: str, handle: Any) -> None:
        _close(handle, unlink=True)


class ShmReceiver(SlotReceiver):
    """Engine-worker half of ``shm``: maps the trainer's segments (each once) and copies out."""

    name: ClassVar[str] = "shm"

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        super().__init__(spec, rank=rank, device="cpu")

    def _open_slot(self, name: str, info: dict[str, Any], index: int) -> tuple[Any, torch.Tensor]:
        try:
            seg = _Attached(name)
        except FileNotFoundError:
            raise WeightSyncError(f"shm: segment {name} is gone", peer=TRAINER, bucket=index) from None
        return seg, _view(seg, seg.size)

    def _close_slot(self, name: str, handle: Any, trainer_gone: bool) -> None:
        _close(handle, unlink=False)

    def _after_detach(self, trainer_gone: bool, names: list[str]) -> None:
        if not trainer_gone:
            return
        # A killed trainer cannot unlink its segments; they are numbered 1, 2, ..., so remove every
        # one up to the highest any log named (also in an earlier, aborted update, whose slots we
        # closed already) and the two it may have packed into before publishing them; where
        # segments are listed (Linux), any other named for this weight sync too.
        sid = self.spec.session_id
        top = max([self.highest_slot, *(slot_number(n) for n in names)])
        doomed = {slot_name(sid, n) for n in range(1, top + 3)}
        prefix = slot_name(sid, 0)[:-1]
        with contextlib.suppress(OSError):
            doomed.update(n for n in os.listdir(_SHM_DIR) if n.startswith(prefix) and n[len(prefix) :].isdigit())
        for name in sorted(doomed):
            try:
                _Attached.unlink_name(name)
            except FileNotFoundError:
                pass
