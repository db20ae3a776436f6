"""Two reused bucket slots that receivers read in place, signalled through the TCPStore.

The shared machinery of ``shm`` (shared-memory segments) and ``cuda_ipc`` (CUDA IPC handles of
device buffers). The sender owns two slots and hands them to the session as its bucket buffers
(the session packs straight into them, no extra copy). For bucket ``k`` it publishes
``<token>/ready/<k>`` (header, slot name) in the session's store; every receiver waits for it,
reads the slot in place and acknowledges with ``<token>/ack/<k>/<rank>`` once it has copied the
bucket out. Before a slot is packed again the sender waits for every acknowledgement of the
bucket that last used it, so ``send_bucket(k)`` returns once bucket ``k-1`` is acknowledged:
receivers read ``k`` while the trainer packs ``k+1``. A receiver opens each slot once (cached by
name) and reuses it for every later bucket and update.
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar

import torch

from ...errors import WeightSyncError
from ..buckets import BucketHeader
from ..manifest import TransportSpec, WeightManifest
from ..transport import TransportReceiver, TransportSender
from . import _store
from ._store import TRAINER

logger = logging.getLogger("rollout_engines.weights")


class SlotSender(TransportSender):
    """Trainer half: subclasses make and free slots (``_make_slot``/``_free_slot``)."""

    def __init__(self, *, session_id: str, world_size: int, timeout_s: float, options: dict[str, Any]):
        super().__init__(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options)
        self._store, self._spec = _store.host_store(self.options, timeout_s)
        self._kv = _store.session_store(self._store, session_id)
        self._watch = _store.PeerWatch(self._kv, range(1, world_size), self._spec["dead_after_s"])
        self._slots: list[tuple[str, Any, torch.Tensor] | None] = [None, None]
        self._made = 0
        self._token = ""
        self._unacked: list[int] = []

    # -- what a slot is (subclasses) --
    def _make_slot(self, name: str, nbytes: int) -> tuple[Any, torch.Tensor]:
        raise NotImplementedError

    def _free_slot(self, name: str, handle: Any) -> None:
        raise NotImplementedError

    def _ready(self) -> dict[str, Any]:
        """Called before a bucket is published (e.g. wait for the device); extra info for receivers."""
        return {}

    # -- protocol --
    def spec_options(self) -> dict[str, Any]:
        return dict(self._spec)

    def connect(self) -> None:
        # Receivers announce themselves by their first heartbeat.
        keys = [f"hb/{r}" for r in range(1, self.world_size)]
        _store.poll(
            lambda: bool(self._kv.check(keys)), timeout_s=self.timeout_s, check=lambda: None,
            on_timeout=lambda: WeightSyncError(
                f"{self.name}: engines did not connect within {self.timeout_s:.0f} s", peer="receivers"
            ),
        )

    def _slot(self, index: int, nbytes: int) -> tuple[str, Any, torch.Tensor]:
        slot = index % 2
        have = self._slots[slot]
        if have is None or have[2].numel() < nbytes:
            if have is not None:
                self._free_slot(have[0], have[1])
            self._made += 1
            name = f"roe_{self.session_id}_{self._made}"
            handle, tensor = self._make_slot(name, max(nbytes, 1))
            have = self._slots[slot] = (name, handle, tensor)
        return have

    def bucket_buffer(self, index: int, nbytes: int) -> torch.Tensor | None:
        return self._slot(index, nbytes)[2]

    def begin(self, manifest: WeightManifest) -> None:
        self._token = manifest.session_id
        self._unacked = []
        self._watch.clear()

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        name, _, view = self._slot(header.index, header.nbytes)
        if buf.data_ptr() != view.data_ptr():
            view[: header.nbytes].copy_(buf[: header.nbytes])
        self._publish(header, slot=name, size=view.numel())

    def _publish(self, header: BucketHeader, **extra: Any) -> None:
        info = header.model_dump(exclude={"ABORT"})
        info.update(self._ready(), **extra)
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
            peer="receivers", bucket=index,
        )
        for key in keys:
            self._kv.delete_key(key)
        self._kv.delete_key(f"{self._token}/ready/{index}")
        self._acked(index)

    def _acked(self, index: int) -> None:
        """Every receiver is done with bucket ``index``."""

    def _late(self, keys: list[str], index: int) -> WeightSyncError:
        missing = [k.rsplit("/", 1)[1] for k in keys if not self._kv.check([k])]
        return WeightSyncError(
            f"{self.name}: receiver rank(s) {', '.join(missing)} did not take the bucket within "
            f"{self.timeout_s:.0f} s", peer=f"rank {missing[0]}" if missing else "receivers", bucket=index,
        )

    def end(self, manifest: WeightManifest) -> None:
        while self._unacked:
            self._wait_acks(self._unacked.pop(0))

    def abort(self, reason: str) -> None:
        try:
            self._kv.set(f"{self._token}/abort", reason[:1000])
        finally:
            # Start the next update on fresh slots: a receiver may still be reading these.
            self._drop_slots()

    def _drop_slots(self) -> None:
        for i, have in enumerate(self._slots):
            if have is not None:
                self._free_slot(have[0], have[1])
            self._slots[i] = None

    def close(self) -> None:
        self._drop_slots()


class SlotReceiver(TransportReceiver):
    """Engine-worker half: subclasses open and close slots (``_open_slot``/``_close_slot``)."""

    keeps_buffer: ClassVar[bool] = False

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        super().__init__(spec, rank=rank, device=device)
        self._kv: Any = None
        self._beat: _store.Heartbeat | None = None
        self._open: dict[str, tuple[Any, torch.Tensor]] = {}
        self._token = ""
        self._last = -1
        self._used: set[str] = set()
        self._manifest: WeightManifest | None = None

    # -- what a slot is (subclasses) --
    def _open_slot(self, name: str, info: dict[str, Any], index: int) -> tuple[Any, torch.Tensor]:
        raise NotImplementedError

    def _close_slot(self, name: str, handle: Any, trainer_gone: bool) -> None:
        raise NotImplementedError

    def _before_ack(self) -> None:
        """Called before a bucket is acknowledged (e.g. wait until the device finished reading)."""

    def _after_detach(self, trainer_gone: bool, names: list[str]) -> None:
        """Called after every slot was closed (e.g. remove what a killed trainer left behind)."""

    # -- protocol --
    def connect(self) -> None:
        self._kv = _store.session_store(_store.join_store(self.spec.options, self.timeout_s), self.spec.session_id)
        self._beat = _store.Heartbeat(self.spec.options, self.spec.session_id, self.rank, self.timeout_s)

    def _open_shared(self, info: dict[str, Any], index: int) -> list[torch.Tensor]:
        """Views of tensors the sender shared without packing (see ``share_tensors``)."""
        raise WeightSyncError(f"{self.name}: the sender shared bucket {index} in a way this receiver cannot read",
                              peer=TRAINER, bucket=index)

    def _last_release(self) -> None:
        """Called before the last bucket of an update is acknowledged."""

    def begin(self, manifest: WeightManifest) -> None:
        with _store.trainer_link(0):
            self._token, self._last, self._used = manifest.session_id, -1, set()
            self._manifest = manifest
            _store.report_progress(self._kv, self.rank, -1)

    def _check(self, index: int) -> None:
        assert self._beat is not None
        self._beat.check()
        _store.raise_if_aborted(self._kv, f"{self._token}/abort", self.name, index)

    def recv_bucket(self, index: int, nbytes: int) -> tuple[BucketHeader, torch.Tensor | list[torch.Tensor]]:
        with _store.trainer_link(index):
            key = f"{self._token}/ready/{index}"
            _store.poll(
                lambda: bool(self._kv.check([key])),
                timeout_s=self.timeout_s,
                check=lambda: self._check(index),
                bucket=index,
                on_timeout=lambda: WeightSyncError(
                    f"{self.name}: rank {self.rank} got no bucket within {self.timeout_s:.0f} s",
                    peer=TRAINER, bucket=index,
                ),
            )
            info = json.loads(self._kv.get(key))
        # Opening is not a store operation: its errors (e.g. from the device) keep their own names.
        name = info.pop("slot", None)
        extra = {k: info.pop(k) for k in list(info) if k not in BucketHeader.model_fields}
        header = BucketHeader(**info)
        if name is None:
            self._last = index
            return header, self._open_shared(extra, index)
        with _store.trainer_link(index):
            if name not in self._open:
                self._open[name] = self._open_slot(name, extra, index)
            tensor = self._open[name][1]
            if tensor.numel() < header.nbytes:
                raise WeightSyncError(f"{self.name}: slot {name} is smaller than the bucket", peer=TRAINER, bucket=index)
            self._last = index
            self._used.add(name)
            return header, tensor[: header.nbytes]

    def release(self, index: int) -> None:
        self._before_ack()
        if self._manifest is not None and index == len(self._manifest.buckets) - 1:
            self._last_release()
        with _store.trainer_link(index):
            _store.report_progress(self._kv, self.rank, index)
            self._kv.set(f"{self._token}/ack/{index}/{self.rank}", "1")

    def end(self, manifest: WeightManifest, ok: bool) -> None:
        if ok:
            # Keep the two current slots open for the next update; drop any the trainer replaced.
            for name in [n for n in self._open if n not in self._used]:
                self._close_slot(name, self._open.pop(name)[0], trainer_gone=False)
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
        names = list(self._open)
        for name, (handle, _) in self._open.items():
            self._close_slot(name, handle, trainer_gone=gone)
        self._open.clear()
        self._after_detach(gone, names)

    def close(self) -> None:
        self._detach()
        if self._beat is not None:
            self._beat.close()
            self._beat = None
