"""``shm``: two shared-memory slots on one host, reused in turn; signals through the TCPStore.

The CPU analogue of ``cuda_ipc``. The sender owns two ``multiprocessing.shared_memory`` segments
and hands them to the session as its bucket buffers (the session packs straight into shared
memory, no extra copy). For bucket ``k`` it publishes ``ready/<k>`` (header, segment name) in the
session's store; every receiver waits for it, reads the slot and acknowledges with
``ack/<k>/<rank>`` once it has copied the bucket out. Before the sender packs a slot again it
waits for every acknowledgement of the bucket that last used it, so ``send_bucket(k)`` returns
once bucket ``k-1`` is acknowledged: receivers read ``k`` while the trainer packs ``k+1``.

Receivers copy out (``keeps_buffer = False``). The sender unlinks its segments on close and after
a failed update (new segments are made for the next one); receivers detach from them on close,
on failure, and unlink them if the trainer died (a killed trainer cannot).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from multiprocessing import shared_memory
from typing import Any, ClassVar

import torch

from ...errors import WeightSyncError
from ..buckets import BucketHeader
from ..manifest import TransportSpec, WeightManifest
from ..transport import TransportReceiver, TransportSender
from . import _store
from ._store import TRAINER

logger = logging.getLogger("rollout_engines.weights")


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


class ShmSender(TransportSender):
    """Trainer half of ``shm``."""

    name: ClassVar[str] = "shm"

    def __init__(self, *, session_id: str, world_size: int, timeout_s: float, options: dict[str, Any]):
        super().__init__(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options)
        self._store, self._spec = _store.host_store(self.options, timeout_s)
        self._kv = _store.session_store(self._store, session_id)
        self._watch = _store.PeerWatch(self._kv, range(1, world_size), self._spec["dead_after_s"])
        self._slots: list[tuple[shared_memory.SharedMemory, torch.Tensor] | None] = [None, None]
        self._made = 0
        self._token = ""
        self._unacked: list[int] = []

    def spec_options(self) -> dict[str, Any]:
        return dict(self._spec)

    def connect(self) -> None:
        # Receivers announce themselves by their first heartbeat.
        keys = [f"hb/{r}" for r in range(1, self.world_size)]
        _store.poll(
            lambda: bool(self._kv.check(keys)), timeout_s=self.timeout_s, check=lambda: None,
            on_timeout=lambda: WeightSyncError(
                f"shm: engines did not connect within {self.timeout_s:.0f} s", peer="receivers"
            ),
        )

    def _slot(self, index: int, nbytes: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
        slot = index % 2
        have = self._slots[slot]
        if have is None or have[0].size < nbytes:
            if have is not None:
                _close(have[0], unlink=True)
            self._made += 1
            name = f"roe_{self.session_id}_{self._made}"
            seg = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
            have = (seg, _view(seg, seg.size))
            self._slots[slot] = have
        return have

    def bucket_buffer(self, index: int, nbytes: int) -> torch.Tensor | None:
        return self._slot(index, nbytes)[1]

    def begin(self, manifest: WeightManifest) -> None:
        self._token = manifest.session_id
        self._unacked = []
        self._watch.clear()

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        seg, view = self._slot(header.index, header.nbytes)
        if buf.data_ptr() != view.data_ptr():
            view[: header.nbytes].copy_(buf[: header.nbytes])
        info = header.model_dump(exclude={"ABORT"})
        info.update(segment=seg.name, size=seg.size)
        self._kv.set(f"{self._token}/ready/{header.index}", json.dumps(info))
        self._unacked.append(header.index)
        while len(self._unacked) > 1:  # the slot of bucket k-1 must be free when we return
            self._wait_acks(self._unacked.pop(0))

    def _wait_acks(self, index: int) -> None:
        keys = [f"{self._token}/ack/{index}/{r}" for r in range(1, self.world_size)]
        _store.poll(
            lambda: bool(self._kv.check(keys)),
            timeout_s=self.timeout_s,
            check=lambda: self._watch.check(index),
            on_timeout=lambda: self._late(keys, index),
        )
        for key in keys:
            self._kv.delete_key(key)
        self._kv.delete_key(f"{self._token}/ready/{index}")

    def _late(self, keys: list[str], index: int) -> WeightSyncError:
        missing = [k.rsplit("/", 1)[1] for k in keys if not self._kv.check([k])]
        return WeightSyncError(
            f"shm: receiver rank(s) {', '.join(missing)} did not take the bucket within {self.timeout_s:.0f} s",
            peer=f"rank {missing[0]}" if missing else "receivers", bucket=index,
        )

    def end(self, manifest: WeightManifest) -> None:
        while self._unacked:
            self._wait_acks(self._unacked.pop(0))

    def abort(self, reason: str) -> None:
        try:
            self._kv.set(f"{self._token}/abort", reason[:1000])
        finally:
            # Start the next update on fresh segments: nobody may still read these.
            self._drop_slots()

    def _drop_slots(self) -> None:
        for i, have in enumerate(self._slots):
            if have is not None:
                _close(have[0], unlink=True)
            self._slots[i] = None

    def close(self) -> None:
        self._drop_slots()


class ShmReceiver(TransportReceiver):
    """Engine-worker half of ``shm``: reads buckets from the trainer's segments."""

    name: ClassVar[str] = "shm"
    keeps_buffer: ClassVar[bool] = False

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        super().__init__(spec, rank=rank, device="cpu")
        self._kv: Any = None
        self._beat: _store.Heartbeat | None = None
        self._open: dict[str, _Attached] = {}
        self._token = ""
        self._last = -1
        self._used: set[str] = set()

    def connect(self) -> None:
        self._kv = _store.session_store(_store.join_store(self.spec.options, self.timeout_s), self.spec.session_id)
        self._beat = _store.Heartbeat(self.spec.options, self.spec.session_id, self.rank, self.timeout_s)

    def begin(self, manifest: WeightManifest) -> None:
        with _store.trainer_link(0):
            self._token, self._last, self._used = manifest.session_id, -1, set()
            _store.report_progress(self._kv, self.rank, -1)

    def _check(self, index: int) -> None:
        assert self._beat is not None
        self._beat.check()
        key = f"{self._token}/abort"
        if self._kv.check([key]):
            reason = self._kv.get(key).decode(errors="replace")
            raise WeightSyncError(f"shm: the trainer aborted the update: {reason}", peer=TRAINER, bucket=index)

    def _attach(self, name: str) -> _Attached:
        seg = self._open.get(name)
        if seg is None:
            seg = self._open[name] = _Attached(name)
        return seg

    def recv_bucket(self, index: int, nbytes: int) -> tuple[BucketHeader, torch.Tensor]:
        with _store.trainer_link(index):
            key = f"{self._token}/ready/{index}"
            _store.poll(
                lambda: bool(self._kv.check([key])),
                timeout_s=self.timeout_s,
                check=lambda: self._check(index),
                bucket=index,
                on_timeout=lambda: WeightSyncError(
                    f"shm: rank {self.rank} got no bucket within {self.timeout_s:.0f} s", peer=TRAINER, bucket=index
                ),
            )
            info = json.loads(self._kv.get(key))
            segment, size = info.pop("segment"), info.pop("size")
            header = BucketHeader(**info)
            try:
                seg = self._attach(segment)
            except FileNotFoundError:
                raise WeightSyncError(f"shm: segment {segment} is gone", peer=TRAINER, bucket=index) from None
            if seg.size < min(size, header.nbytes):
                raise WeightSyncError(f"shm: segment {segment} is smaller than the bucket", peer=TRAINER, bucket=index)
            self._last = index
            self._used.add(segment)
            return header, _view(seg, header.nbytes)

    def release(self, index: int) -> None:
        with _store.trainer_link(index):
            _store.report_progress(self._kv, self.rank, index)
            self._kv.set(f"{self._token}/ack/{index}/{self.rank}", "1")

    def end(self, manifest: WeightManifest, ok: bool) -> None:
        if ok:
            # Keep the two current slots mapped for the next update; drop any the trainer replaced.
            for name in [n for n in self._open if n not in self._used]:
                _close(self._open.pop(name), unlink=False)
            return
        if self._last != len(manifest.buckets) - 1:
            _store.report_failure(self._kv, self.rank, f"update v{manifest.version} failed at bucket {self._last + 1}")
        self._detach()

    def _trainer_gone(self) -> bool:
        if self._beat is not None and self._beat.error is not None:
            return True
        try:
            self._kv.check(["alive"])
            return False
        except Exception:
            return True

    def _detach(self) -> None:
        gone = self._kv is not None and self._trainer_gone()
        for seg in self._open.values():
            _close(seg, unlink=False)
        if gone:
            # A killed trainer cannot unlink its slots; its segments are numbered 1, 2, ... (a slot
            # it made but we never opened included), so remove them here.
            made = [int(n.rsplit("_", 1)[1]) for n in self._open]
            for n in range(1, max(made, default=0) + 3):
                try:
                    _Attached.unlink_name(f"roe_{self.spec.session_id}_{n}")
                except FileNotFoundError:
                    pass
        self._open.clear()

    def close(self) -> None:
        self._detach()
        if self._beat is not None:
            self._beat.close()
            self._beat = None
