"""``inproc``: trainer and engine in one process; buckets are handed over through queues.

Each item carries its update's token (the manifest's ``session_id``): a receiver takes only its
current update's buckets and drops what an earlier one left in its queue (an update the engine
refused before reading it, or one that was cancelled), so no bucket lands in the wrong update."""

from __future__ import annotations

import queue
import threading
import time
from typing import ClassVar

import torch

from ...errors import WeightSyncError
from ..buckets import BucketHeader
from ..manifest import TransportSpec, WeightManifest
from .base import TransportReceiver, TransportSender

_Item = tuple[str, BucketHeader, torch.Tensor]
_sessions: dict[str, dict[int, queue.Queue[_Item]]] = {}
#: How long one wait on a queue lasts before the half checks whether it was cancelled.
_CHECK_S = 0.5
_lock = threading.Condition()


class InprocSender(TransportSender):
    name: ClassVar[str] = "inproc"
    reuses_buffers: ClassVar[bool] = False

    def connect(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        with _lock:
            while len(_sessions.get(self.session_id, {})) < self.world_size - 1:
                self.raise_if_cancelled()  # an engine refused to join (cancel does not notify)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncError("inproc: receivers did not join in time", peer="engine")
                _lock.wait(min(left, _CHECK_S))

    _token = ""

    def _queues(self) -> dict[int, queue.Queue[_Item]]:
        with _lock:
            return dict(_sessions.get(self.session_id, {}))

    def begin(self, manifest: WeightManifest) -> None:
        self._token = manifest.session_id

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        for rank, q in self._queues().items():
            deadline = time.monotonic() + self.timeout_s
            while True:  # short waits: a cancelled push (an engine refused) stops within one
                self.raise_if_cancelled(header.index)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncError("inproc: receiver stopped reading", peer=f"rank {rank}", bucket=header.index)
                try:
                    q.put((self._token, header, buf), timeout=min(left, _CHECK_S))
                    break
                except queue.Full:
                    continue

    def abort(self, reason: str) -> None:
        item = (self._token, BucketHeader(index=-1, nbytes=0, status=BucketHeader.ABORT, reason=reason), torch.empty(0))
        for q in self._queues().values():
            # A full queue is normal (the receiver is still applying); wait for a slot instead of
            # dropping the abort, or the receiver would wait for the next bucket until its timeout.
            try:
                q.put(item, timeout=min(self.timeout_s, 10.0))
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
        self.queue: queue.Queue[_Item] = queue.Queue(maxsize=2)
        self._token = ""

    def connect(self) -> None:
        with _lock:
            _sessions.setdefault(self.spec.session_id, {})[self.rank] = self.queue
            _lock.notify_all()

    def begin(self, manifest: WeightManifest) -> None:
        self._token = manifest.session_id

    def end(self, manifest: WeightManifest, ok: bool) -> None:
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
                token, header, buf = self.queue.get(timeout=min(left, _CHECK_S))
            except queue.Empty:
                continue
            if token == self._token:
                break
            # An earlier update's bucket (refused or cancelled before this receiver read it): dropped.
        return header, buf.to(self.device, non_blocking=True) if buf.device != self.device else buf

    def close(self) -> None:
        with _lock:
            _sessions.get(self.spec.session_id, {}).pop(self.rank, None)
