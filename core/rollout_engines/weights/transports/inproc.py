"""``inproc``: trainer and engine in one process; buckets are handed over through queues."""

from __future__ import annotations

import queue
import threading
import time
from typing import ClassVar

import torch

from ...errors import WeightSyncError
from ..buckets import BucketHeader
from ..manifest import TransportSpec
from .base import TransportReceiver, TransportSender

_sessions: dict[str, dict[int, queue.Queue[tuple[BucketHeader, torch.Tensor]]]] = {}
_lock = threading.Condition()


class InprocSender(TransportSender):
    name: ClassVar[str] = "inproc"
    reuses_buffers: ClassVar[bool] = False

    def connect(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        with _lock:
            while len(_sessions.get(self.session_id, {})) < self.world_size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncError("inproc: receivers did not join in time", peer="engine")
                _lock.wait(left)

    def _queues(self) -> dict[int, queue.Queue[tuple[BucketHeader, torch.Tensor]]]:
        with _lock:
            return dict(_sessions.get(self.session_id, {}))

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        for rank, q in self._queues().items():
            try:
                q.put((header, buf), timeout=self.timeout_s)
            except queue.Full:
                raise WeightSyncError("inproc: receiver stopped reading", peer=f"rank {rank}", bucket=header.index) from None

    def abort(self, reason: str) -> None:
        for q in self._queues().values():
            # A full queue is normal (the receiver is still applying); wait for a slot instead of
            # dropping the abort, or the receiver would wait for the next bucket until its timeout.
            try:
                q.put((BucketHeader(index=-1, nbytes=0, status=BucketHeader.ABORT, reason=reason), torch.empty(0)),
                      timeout=min(self.timeout_s, 10.0))
            except queue.Full:
                pass

    def close(self) -> None:
        with _lock:
            _sessions.pop(self.session_id, None)


class InprocReceiver(TransportReceiver):
    name: ClassVar[str] = "inproc"

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        super().__init__(spec, rank=rank, device=device)
        # Several engines in one process would otherwise share one storage: copy unless alone.
        self.keeps_buffer = spec.world_size == 2  # type: ignore[misc]
        self.queue: queue.Queue[tuple[BucketHeader, torch.Tensor]] = queue.Queue(maxsize=2)

    def connect(self) -> None:
        with _lock:
            _sessions.setdefault(self.spec.session_id, {})[self.rank] = self.queue
            _lock.notify_all()

    def end(self, manifest, ok: bool) -> None:  # type: ignore[no-untyped-def]
        if not ok:  # drop what a failed update left unread, so the next one starts clean
            while not self.queue.empty():
                self.queue.get_nowait()

    def recv_bucket(self, index: int, nbytes: int) -> tuple[BucketHeader, torch.Tensor]:
        deadline = time.monotonic() + self.timeout_s
        while True:  # short waits, so a cancelled receive gives up within half a second
            self.raise_if_cancelled(index)
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncError(f"inproc: no bucket within {self.timeout_s:.0f} s", peer="trainer", bucket=index)
            try:
                header, buf = self.queue.get(timeout=min(left, 0.5))
                break
            except queue.Empty:
                continue
        return header, buf.to(self.device, non_blocking=True) if buf.device != self.device else buf

    def close(self) -> None:
        with _lock:
            _sessions.get(self.spec.session_id, {}).pop(self.rank, None)
