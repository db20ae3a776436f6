"""Two reused bucket slots that receivers read in place, signalled through the TCPStore.

The shared machinery of ``shm`` (shared-memory segments) and ``cuda_ipc`` (CUDA IPC handles of
device buffers). The sender owns two slots and hands them to the session as its bucket buffers
(the session packs straight into them, no extra copy).

Signalling costs a few store round trips per push, not per bucket:

- the sender appends each bucket's description (header, slot name; one JSON line, optionally
  followed by a tab and a document the receiver keeps unparsed; each line signed, see
  :class:`._store.SignedStore`, so segment names and pointers come only from the trainer) to one log per update,
  ``<token>/log``; a receiver reads everything published so far with one ``get`` and waits only
  when the bucket it needs is not there yet;
- each receiver acknowledges with one key, ``ack/<rank>`` = ``<token>:<index>``: every bucket up
  to ``index`` of update ``<token>`` is copied out. A bucket in a slot is acknowledged at once
  (the sender packs that slot again two buckets later: before a slot is packed again the sender
  waits for the bucket that last used it, so receivers read ``k`` while the trainer packs
  ``k+1``). A bucket the receiver reads where the trainer keeps it anyway (zero-copy ``cuda_ipc``
  of parameters) is marked ``ack: false``: nothing waits for it. When every bucket of an update is
  such a bucket, the sender does not wait for the last one's acknowledgement either (receivers
  still send it): nothing of the sender's is reused, and the engine's answer to the receive call,
  which the session awaits, says the same thing, one process hop sooner.

A receiver opens each slot once (cached by name) and reuses it for every later bucket and update.
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar

import torch

from ...errors import WeightSyncError
from ..buckets import BucketHeader
from ..manifest import TransportSpec, WeightManifest
from . import _store
from ._store import TRAINER
from .base import TransportReceiver, TransportSender

logger = logging.getLogger("rollout_engines.weights")


def slot_name(session_id: str, number: int) -> str:
    """The name of the sender's ``number``-th slot of a session (counted from 1, never reused)."""
    return f"roe_{session_id}_{number}"


def slot_number(name: str) -> int:
    """The number in a slot's name (0 if it has none)."""
    tail = name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 0


class SlotSender(TransportSender):
    """Trainer half: subclasses make and free slots (``_make_slot``/``_free_slot``)."""

    def __init__(self, *, session_id: str, world_size: int, timeout_s: float, options: dict[str, Any]):
        super().__init__(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options)
        store, self._spec = _store.host_store(self.options, timeout_s)
        self._kv = _store.session_store(store, session_id, self._spec["secret"])  # the only hold on the store
        self._watch = _store.PeerWatch(
            self._kv, range(1, world_size), self._spec["dead_after_s"], cancelled=self.raise_if_cancelled
        )
        self._slots: list[tuple[str, Any, torch.Tensor] | None] = [None, None]
        self._made = 0
        self._token = ""
        self._stale_logs: list[str] = []  # tokens of earlier updates whose logs are not deleted yet
        self._unacked: list[int] = []  # published, not yet known to be acknowledged by all
        self._must: list[int] = []  # of those, the ones receivers acknowledge at once
        self._any_must = False  # whether any bucket of this update asked for an acknowledgement
        self._acked_upto = -1
        self._ack_keys = [f"ack/{r}" for r in range(1, world_size)]

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
            lambda: bool(self._kv.check(keys)), timeout_s=self.timeout_s, check=self.raise_if_cancelled,
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
            name = slot_name(self.session_id, self._made)
            handle, tensor = self._make_slot(name, max(nbytes, 1))
            have = self._slots[slot] = (name, handle, tensor)
        return have

    def bucket_buffer(self, index: int, nbytes: int) -> torch.Tensor | None:
        return self._slot(index, nbytes)[2]

    def begin(self, manifest: WeightManifest) -> None:
        # The last update's log is deleted in this one's end(), while receivers copy: no round
        # trip before the first bucket.
        if self._token:
            self._stale_logs.append(self._token)
        self._token = manifest.session_id
        self._unacked, self._must, self._acked_upto = [], [], -1
        self._any_must = False
        # Failures reported for earlier updates no longer count: no round trip before the first bucket.
        self._watch.token = self._token

    def _drop_log(self, token: str) -> None:
        if token:
            try:
                self._kv.delete_key(f"{token}/log")
            except Exception:  # the store may be shutting down with us
                pass

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        name, _, view = self._slot(header.index, header.nbytes)
        if buf.data_ptr() != view.data_ptr():
            view[: header.nbytes].copy_(buf[: header.nbytes])
        self._publish(header, slot=name, size=view.numel())

    def _publish(self, header: BucketHeader, *, ack: bool = True, raw: str = "", **extra: Any) -> None:
        """Describe bucket ``header.index`` to the receivers. ``ack``: they acknowledge it at once
        (its memory is reused or held for them); otherwise the last bucket's acknowledgement covers it.
        ``raw``: a JSON document (no newline) the receiver gets unparsed, as ``info['raw']`` (a
        description that comes back unchanged push after push is serialized, and read, once)."""
        info = header.model_dump(exclude={"ABORT"})
        info.update(self._ready(), ack=ack, **extra)
        self._kv.append_line(f"{self._token}/log", json.dumps(info) + ("\t" + raw if raw else ""))
        self._unacked.append(header.index)
        if ack:
            self._any_must = True
            self._must.append(header.index)
            while len(self._must) > 1:  # the slot of the previous such bucket must be free when we return
                self._wait_acked(self._must.pop(0))

    def _lowest_ack(self) -> int:
        """The last bucket of this update that every receiver acknowledged (-1: none yet)."""
        if not self._ack_keys:  # no receivers: nothing to wait for
            return 1 << 62
        low = None
        if len(self._ack_keys) == 1:  # one round trip (a multi_get waits for its keys first: two)
            values = [self._kv.read(self._ack_keys[0]) or b"-:-1"]
        else:
            values = self._kv.multi_get(self._ack_keys)
        for value in values:
            token, _, index = value.decode().partition(":")
            got = int(index) if token == self._token else -1
            low = got if low is None else min(low, got)
        return -1 if low is None else low

    def _wait_acked(self, index: int) -> None:
        def done() -> bool:
            if self._acked_upto < index:
                low = self._lowest_ack()
                while self._unacked and self._unacked[0] <= low:
                    self._acked(self._unacked.pop(0))
                self._acked_upto = max(self._acked_upto, low)
            return self._acked_upto >= index

        _store.poll(
            done, timeout_s=self.timeout_s, check=lambda: self._watch.check(index),
            on_timeout=lambda: self._late(index), peer="receivers", bucket=index,
        )

    def _acked(self, index: int) -> None:
        """Every receiver is done with bucket ``index``."""

    def _final_ack_needed(self) -> bool:
        """Whether :meth:`end` must wait for the last bucket's acknowledgement although no bucket
        of this update asked for one (e.g. receivers unmap memory the sender then lets go)."""
        return False

    def _late(self, index: int) -> WeightSyncError:
        missing = []
        for key, value in zip(self._ack_keys, self._kv.multi_get(self._ack_keys), strict=True):
            token, _, got = value.decode().partition(":")
            if token != self._token or int(got) < index:
                missing.append(key.rsplit("/", 1)[1])
        return WeightSyncError(
            f"{self.name}: receiver rank(s) {', '.join(missing)} did not take the bucket within "
            f"{self.timeout_s:.0f} s", peer=f"rank {missing[0]}" if missing else "receivers", bucket=index,
        )

    def end(self, manifest: WeightManifest) -> None:
        while self._stale_logs:
            self._drop_log(self._stale_logs.pop())
        if self._unacked and (self._any_must or self._final_ack_needed()):
            self._wait_acked(self._unacked[-1])

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
        for token in [*self._stale_logs, self._token]:
            self._drop_log(token)
        self._stale_logs = []
        self._drop_slots()
        self._kv.close()  # nothing listens for a closed session


class SlotReceiver(TransportReceiver):
    """Engine-worker half: subclasses open and close slots (``_open_slot``/``_close_slot``)."""

    keeps_buffer: ClassVar[bool] = False
    reuses_slots: ClassVar[bool] = True

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        super().__init__(spec, rank=rank, device=device)
        self._kv: Any = None
        self._beat: _store.Heartbeat | None = None
        self._open: dict[str, tuple[Any, torch.Tensor]] = {}
        self._token = ""
        self._last = -1
        self._used: set[str] = set()
        self._manifest: WeightManifest | None = None
        self._infos: dict[int, dict[str, Any]] = {}  # published bucket descriptions not yet taken
        self._log_read = 0  # bytes of this update's log already parsed
        self._must_ack: dict[int, bool] = {}
        #: The highest slot number any update's log named: the trainer made no slot above it except
        #: the ones it packs into before publishing (a killed trainer's leftovers, see _after_detach).
        self.highest_slot = 0

    # -- what a slot is (subclasses) --
    def _open_slot(self, name: str, info: dict[str, Any], index: int) -> tuple[Any, torch.Tensor]:
        raise NotImplementedError

    def _close_slot(self, name: str, handle: Any, trainer_gone: bool) -> None:
        raise NotImplementedError

    def _before_ack(self) -> None:
        """Called before a bucket is acknowledged (e.g. wait until the device finished reading)."""

    def _after_detach(self, trainer_gone: bool, names: list[str]) -> None:
        """Called after every slot was closed (``names``: those that were open; e.g. remove what a
        killed trainer left behind)."""

    # -- protocol --
    def connect(self) -> None:
        secret = _store.session_secret(self.spec.options)
        self._kv = _store.session_store(
            _store.join_store(self.spec.options, self.timeout_s), self.spec.session_id, secret
        )
        self._kv.set(f"ack/{self.rank}", "-:-1")  # before the first heartbeat: the sender reads it from then on
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
            self._infos, self._log_read, self._must_ack = {}, 0, {}
            _store.report_progress(self._kv, self.rank, -1)

    def _check(self, index: int) -> None:
        assert self._beat is not None
        self.raise_if_cancelled(index)
        self._beat.check()
        _store.raise_if_aborted(self._kv, f"{self._token}/abort", self.name, index)

    def recv_bucket(self, index: int, nbytes: int) -> tuple[BucketHeader, torch.Tensor | list[torch.Tensor]]:
        with _store.trainer_link(index):
            if index not in self._infos:
                _store.poll(
                    lambda: self._read_log(index),
                    timeout_s=self.timeout_s,
                    check=lambda: self._check(index),
                    bucket=index,
                    on_timeout=lambda: WeightSyncError(
                        f"{self.name}: rank {self.rank} got no bucket within {self.timeout_s:.0f} s",
                        peer=TRAINER, bucket=index,
                    ),
                )
            info = self._infos.pop(index)
        # Opening is not a store operation: its errors (e.g. from the device) keep their own names.
        self._must_ack[index] = bool(info.pop("ack", True))
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

    def _read_log(self, index: int) -> bool:
        """Take the bucket descriptions published since the last look; whether ``index`` is among them."""
        key = f"{self._token}/log"
        lines, self._log_read = self._kv.read_lines(key, self._log_read)
        for line in lines:
            head, _, raw = line.partition("\t")
            info = json.loads(head)
            if raw:
                info["raw"] = raw
            if isinstance(info.get("slot"), str):
                self.highest_slot = max(self.highest_slot, slot_number(info["slot"]))
            self._infos[int(info["index"])] = info
        return index in self._infos

    def release(self, index: int) -> None:
        last = self._manifest is not None and index == len(self._manifest.buckets) - 1
        if not (self._must_ack.pop(index, True) or last):
            # Read where the trainer keeps it: the last bucket's acknowledgement covers it. The
            # progress mark (a set, no reply awaited) still names the right bucket if we die.
            with _store.trainer_link(index):
                _store.report_progress(self._kv, self.rank, index)
            return
        self._before_ack()
        if last:
            self._last_release()
        with _store.trainer_link(index):
            _store.report_progress(self._kv, self.rank, index)
            self._kv.set(f"ack/{self.rank}", f"{self._token}:{index}")

    def end(self, manifest: WeightManifest, ok: bool) -> None:
        if ok:
            # Keep the two current slots open for the next update; drop any the trainer replaced.
            for name in [n for n in self._open if n not in self._used]:
                self._close_slot(name, self._open.pop(name)[0], trainer_gone=False)
            return
        if self._last != len(manifest.buckets) - 1:
            _store.report_failure(self._kv, self.rank, f"update v{manifest.version} failed at bucket {self._last + 1}",
                                  token=self._token)
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
        if self._kv is not None:
            self._kv.close()
