"""``gloo`` and ``nccl``: one broadcast per bucket in a process group made for the session.

The trainer (rank 0) and every engine worker join a process group built without touching
``torch.distributed``'s default group (the trainer may have its own): the trainer hosts a
``TCPStore`` on a free port, every member wraps it in a ``PrefixStore`` for the session and
builds the backend (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) on it directly.

Per bucket the sender broadcasts a small int64 header ``[status, index, nbytes, checksum_hi,
checksum_lo]`` and then the payload, both asynchronously: ``send_bucket(k)`` returns once bucket
``k-1`` is on the wire, so the session packs ``k+1`` while ``k`` travels and never overwrites a
buffer still being sent. An abort is a header with status 1 (its reason is in the store).

Every wait polls the work with a deadline and checks the peers through the store (see
:mod:`._store`): a dead or failed peer gives :class:`WeightSyncError` naming its rank and the
bucket. After any failure the group may be unusable (a collective was left half done), so it is
rebuilt: a receiver that failed reports it through the store; at the start of the next update the
sender, if it or any receiver failed, moves to a new *generation* and publishes it under the
update's token; every receiver reads the generation for that update and, if it changed, joins
the new group (prefix ``g<generation>/``) before the first bucket. No caller action is needed:
the next :meth:`WeightSync.push` just works.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ...errors import WeightSyncError
from ..buckets import BucketHeader
from ..manifest import TransportSpec, WeightManifest
from . import _store
from ._store import TRAINER
from .base import TransportReceiver, TransportSender

logger = logging.getLogger("rollout_engines.weights")

_HEADER_LEN = 5


def _encode(header: BucketHeader, device: torch.device) -> torch.Tensor:
    c = header.checksum
    values = [header.status, header.index, header.nbytes, c >> 32, c & 0xFFFFFFFF]
    return torch.tensor(values, dtype=torch.int64).to(device)


def _decode(t: torch.Tensor) -> BucketHeader:
    status, index, nbytes, hi, lo = (int(v) for v in t.tolist())
    return BucketHeader(status=status, index=index, nbytes=nbytes, checksum=(hi << 32) | lo)


def _opts(timeout_s: float) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return opts


def _make_group(kind: str, store: dist.Store, rank: int, world_size: int, timeout_s: float, device: torch.device) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if kind == "gloo":
        from torch.distributed import ProcessGroupGloo

        # Gloo's constructor is the rendezvous: it returns once every rank has joined.
        return ProcessGroupGloo(store, rank, world_size, timeout)
    from torch.distributed import ProcessGroupNCCL

    torch.cuda.set_device(device)
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, world_size, opts)


#: Gloo groups left by failed updates, each with the time after which its pending collectives
#: have timed out. Aborting or destroying one before then blocks until they do, so it is parked
#: here until that time; a later call of :func:`_drop_group` lets it go (its destructor then has
#: nothing left to wait for).
_abandoned: list[tuple[float, Any]] = []
_abandoned_lock = threading.Lock()
#: Slack past a group's own timeout before a parked group is let go.
ABANDON_SLACK_S = 5.0


def _drop_group(pg: Any, *, timeout_s: float, failed: bool = True) -> None:
    """Let go of a group; after a failure, abandon it without waiting on its pending collectives
    (parked for ``timeout_s``, the group's timeout, plus :data:`ABANDON_SLACK_S`)."""
    now = time.monotonic()
    with _abandoned_lock:
        expired = [g for until, g in _abandoned if until <= now]
        _abandoned[:] = [(until, g) for until, g in _abandoned if until > now]
    del expired  # destroyed here, outside the lock
    if pg is None:
        return
    if failed and hasattr(pg, "abort") and type(pg).__name__ == "ProcessGroupNCCL":
        try:
            pg.abort()  # NCCL's abort is the designed way out of a stuck communicator
        except Exception:
            logger.debug("abort() of an abandoned NCCL group failed", exc_info=True)
        return
    if failed:
        with _abandoned_lock:
            _abandoned.append((now + timeout_s + ABANDON_SLACK_S, pg))


class _BroadcastSender(TransportSender):
    kind: ClassVar[str]

    def __init__(self, *, session_id: str, world_size: int, timeout_s: float, options: dict[str, Any]):
        super().__init__(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options)
        self._device = self._pick_device()
        store, self._spec = _store.host_store(self.options, timeout_s)
        self._kv = _store.session_store(store, session_id, self._spec["secret"])  # holds the store, as groups do
        self._watch = _store.PeerWatch(
            self._kv, range(1, world_size), self._spec["dead_after_s"], cancelled=self.raise_if_cancelled
        )
        self._gen = 0
        self._pg: Any = None
        self._broken = False
        self._token = ""
        self._inflight: list[tuple[int, list[Any], torch.Tensor, torch.Tensor]] = []
        self._in_step = True  # False once a bucket was posted only in part (no abort header then)
        self._next_index = 0

    def _pick_device(self) -> torch.device:
        return torch.device("cpu")

    def spec_options(self) -> dict[str, Any]:
        return dict(self._spec)

    def device(self) -> torch.device:
        return self._device

    def connect(self) -> None:
        self._pg = self._join(0)

    def _join(self, gen: int) -> Any:
        try:
            return _make_group(
                self.kind, dist.PrefixStore(f"g{gen}/", self._kv.raw), 0, self.world_size, self.timeout_s, self._device
            )
        except Exception as exc:
            dead = self._watch.dead_ranks()
            who = f"rank {dead[0]}" if dead else "receivers"
            raise WeightSyncError(
                f"{self.kind}: the engines' workers did not join the weight-sync group within "
                f"{self.timeout_s:.0f} s ({_store._short(exc)}); check that every engine was given the spec",
                peer=who,
            ) from exc

    def begin(self, manifest: WeightManifest) -> None:
        # A rebuild needs a signed report (failed/<rank>), not just the unsigned failure counter,
        # and one of the update before (the watch still holds its token).
        rebuild = self._broken or (self._watch.failures() != self._watch.failures_seen and self._watch.failed_ranks())
        # From here only this update's reports count: a late one of the update before must not fail it.
        self._token = self._watch.token = manifest.session_id
        if rebuild:
            # A previous update failed on some side: start a fresh group everyone can trust.
            _drop_group(self._pg, timeout_s=self.timeout_s)
            self._pg = None
            self._gen += 1
            self._watch.clear()
            logger.info("%s: rebuilding the weight-sync group (generation %d)", self.kind, self._gen)
            self._kv.set(f"update/{self._token}", str(self._gen))
            self._pg = self._join(self._gen)
        else:
            self._kv.set(f"update/{self._token}", str(self._gen))
        self._broken, self._in_step, self._next_index = False, True, 0
        self._inflight.clear()

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        opts = _opts(self.timeout_s)
        head = _encode(header, self._device)
        payload = buf[: header.nbytes]
        self._in_step = False
        try:
            works = [self._pg.broadcast([head], opts), self._pg.broadcast([payload], opts)]
        except Exception as exc:
            self._broken = True
            raise self._watch.culprit(header.index, exc, self.kind) from exc
        self._in_step = True
        self._next_index = header.index + 1
        self._inflight.append((header.index, works, head, buf))
        # The contract: once this returns, buffers of earlier buckets may be overwritten.
        while len(self._inflight) > 1:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        index, works, _, _ = self._inflight[0]
        for work in works:
            self._wait(work, index)
        self._inflight.pop(0)

    def _wait(self, work: Any, index: int) -> None:
        try:
            _store.poll(
                work.is_completed,
                timeout_s=self.timeout_s,
                check=lambda: self._watch.check(index),
                on_timeout=lambda: WeightSyncError(
                    f"{self.kind}: bucket not delivered within {self.timeout_s:.0f} s", peer="receivers", bucket=index
                ),
            )
            work.wait()
        except WeightSyncError:
            self._broken = True
            raise
        except Exception as exc:
            self._broken = True
            raise self._watch.culprit(index, exc, self.kind) from exc

    def end(self, manifest: WeightManifest) -> None:
        while self._inflight:
            self._wait_oldest()
        # A broadcast may travel through a tree of receivers: the sender's part can finish while a
        # dead relay starves the others. Wait until every receiver says it has the whole update.
        last = len(manifest.buckets) - 1
        keys = [f"done/{self._token}/{r}" for r in range(1, self.world_size)]
        try:
            _store.poll(
                lambda: self._kv.check(keys) and all(v == b"1" for v in self._kv.multi_get(keys)),
                timeout_s=self.timeout_s,
                check=lambda: self._watch.check(last), peer="receivers", bucket=last,
                on_timeout=lambda: WeightSyncError(
                    f"{self.kind}: receivers did not confirm update v{manifest.version} within "
                    f"{self.timeout_s:.0f} s", peer="receivers", bucket=last,
                ),
            )
        except WeightSyncError:
            self._broken = True
            raise
        for key in keys + [f"update/{self._token}"]:
            self._kv.delete_key(key)

    def abort(self, reason: str) -> None:
        self._kv.set(f"abort/{self._token}", reason[:1000])
        was_broken, self._broken = self._broken, True
        if was_broken or not self._in_step or self._pg is None:
            return  # receivers learn it from the store key
        try:
            while self._inflight:
                self._wait_oldest()
            head = _encode(
                BucketHeader(index=self._next_index, nbytes=0, status=BucketHeader.ABORT, reason=reason), self._device
            )
            self._wait(self._pg.broadcast([head], _opts(self.timeout_s)), self._next_index)
        except WeightSyncError:
            logger.debug("could not broadcast the abort header", exc_info=True)

    def close(self) -> None:
        pg, self._pg = self._pg, None
        _drop_group(pg, failed=self._broken or bool(self._inflight), timeout_s=self.timeout_s)
        self._inflight.clear()
        self._kv.close()  # the store stops listening once no group holds it either


class _BroadcastReceiver(TransportReceiver):
    kind: ClassVar[str]
    #: Every bucket arrives in fresh memory, so staged updates keep it without a copy.
    keeps_buffer: ClassVar[bool] = True

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        super().__init__(spec, rank=rank, device=device)
        self._store: Any = None
        self._kv: Any = None
        self._beat: _store.Heartbeat | None = None
        self._pg: Any = None
        self._gen = 0
        self._token = ""
        self._last = -1
        self._failed = False

    def connect(self) -> None:
        opts = self.spec.options
        self._store = _store.join_store(opts, self.timeout_s)
        self._kv = _store.session_store(self._store, self.spec.session_id, _store.session_secret(opts))
        self._beat = _store.Heartbeat(opts, self.spec.session_id, self.rank, self.timeout_s)
        self._pg = self._join(0)

    def _join(self, gen: int) -> Any:
        try:
            return _make_group(
                self.kind, dist.PrefixStore(f"g{gen}/", self._kv.raw), self.rank, self.spec.world_size,
                self.timeout_s, self.device,
            )
        except Exception as exc:
            raise WeightSyncError(
                f"{self.kind}: rank {self.rank} could not join the weight-sync group: {_store._short(exc)}",
                peer=TRAINER,
            ) from exc

    def _check(self, index: int | None) -> None:
        assert self._beat is not None
        self.raise_if_cancelled(index)
        self._beat.check()
        _store.raise_if_aborted(self._kv, f"abort/{self._token}", self.kind, index)

    def begin(self, manifest: WeightManifest) -> None:
        with _store.trainer_link(0):
            self._token, self._last = manifest.session_id, -1
            key = f"update/{self._token}"
            _store.poll(
                lambda: bool(self._kv.check([key])),
                timeout_s=self.timeout_s,
                check=lambda: self._check(0),
                bucket=0,
                on_timeout=lambda: WeightSyncError(
                    f"{self.kind}: the trainer did not start update v{manifest.version} within {self.timeout_s:.0f} s",
                    peer=TRAINER, bucket=0,
                ),
            )
            _store.report_progress(self._kv, self.rank, -1)
            gen = int(self._kv.get(key))
            if gen != self._gen or self._pg is None:
                _drop_group(self._pg, timeout_s=self.timeout_s)
                self._pg, self._failed = None, False
                self._gen = gen
                self._pg = self._join(gen)

    def _wait(self, work: Any, index: int) -> None:
        try:
            _store.poll(
                work.is_completed,
                timeout_s=self.timeout_s,
                check=lambda: self._check(index),
                bucket=index,
                on_timeout=lambda: WeightSyncError(
                    f"{self.kind}: rank {self.rank} received nothing for {self.timeout_s:.0f} s",
                    peer=TRAINER, bucket=index,
                ),
            )
            work.wait()
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"{self.kind}: broadcast failed: {_store._short(exc)}", peer=TRAINER, bucket=index) from exc

    def recv_bucket(self, index: int, nbytes: int) -> tuple[BucketHeader, torch.Tensor]:
        with _store.trainer_link(index):
            opts = _opts(self.timeout_s)
            head = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            self._wait(self._pg.broadcast([head], opts), index)
            header = _decode(head)
            if header.status == BucketHeader.ABORT:
                key = f"abort/{self._token}"
                if self._kv.check([key]):
                    header.reason = _store._printable(self._kv.get(key).decode(errors="replace"))
                return header, torch.empty(0, dtype=torch.uint8, device=self.device)
            if header.index != index or header.nbytes != nbytes:
                raise WeightSyncError(
                    f"{self.kind}: stream out of step: expected bucket {index} of {nbytes} bytes, "
                    f"got bucket {header.index} of {header.nbytes}", peer=TRAINER, bucket=index,
                )
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._wait(self._pg.broadcast([buf], opts), index)
            self._last = index
            _store.report_progress(self._kv, self.rank, index)
            return header, buf

    def end(self, manifest: WeightManifest, ok: bool) -> None:
        if ok or self._last == len(manifest.buckets) - 1:
            # The whole stream was read: the group is still in step.
            with _store.trainer_link(len(manifest.buckets) - 1):
                self._kv.set(f"done/{self._token}/{self.rank}", "1")
            return
        # Mid-stream failure: tell the sender now (it stops waiting for us) and leave the group;
        # the sender starts a new generation for the next update.
        _store.report_failure(self._kv, self.rank, f"update v{manifest.version} failed at bucket {self._last + 1}",
                              token=self._token)
        _drop_group(self._pg, timeout_s=self.timeout_s)
        self._pg = None
        self._failed = True

    def close(self) -> None:
        _drop_group(self._pg, failed=self._failed, timeout_s=self.timeout_s)
        self._pg = None
        if self._beat is not None:
            self._beat.close()
            self._beat = None
        if self._kv is not None:
            self._kv.close()
        self._store = None  # the connection closes with the last hold on it


class GlooSender(_BroadcastSender):
    """Trainer half of ``gloo`` (CPU tensors; any host reachable over TCP)."""

    name: ClassVar[str] = "gloo"
    kind: ClassVar[str] = "gloo"


class GlooReceiver(_BroadcastReceiver):
    """Engine-worker half of ``gloo``."""

    name: ClassVar[str] = "gloo"
    kind: ClassVar[str] = "gloo"

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        super().__init__(spec, rank=rank, device="cpu")  # gloo moves CPU tensors; the target copies on


class NcclSender(_BroadcastSender):
    """Trainer half of ``nccl``: buckets live on the trainer's current CUDA device
    (``options['device']`` to choose another)."""

    name: ClassVar[str] = "nccl"
    kind: ClassVar[str] = "nccl"

    def _pick_device(self) -> torch.device:
        if not torch.cuda.is_available():
            raise WeightSyncError("nccl needs a CUDA device in the trainer; use 'gloo' on CPU")
        dev = self.options.get("device")
        return torch.device(dev) if dev is not None else torch.device("cuda", torch.cuda.current_device())



class NcclReceiver(_BroadcastReceiver):
    """Engine-worker half of ``nccl``: receives on the worker's own device."""

    name: ClassVar[str] = "nccl"
    kind: ClassVar[str] = "nccl"

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cuda"):
        dev = torch.device(device)
        if dev.type != "cuda":
            raise WeightSyncError(f"nccl receives on a CUDA device, not {dev}; use 'gloo' on CPU")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(spec, rank=rank, device=dev)
