"""The two halves every weight transport implements.

A transport moves bucket buffers from the trainer (one sender) to every engine worker (N
receivers). It knows nothing about models: the manifest, validation and atomic apply live in
:mod:`..receiver` and :mod:`..session`, shared by every transport.

Rules every transport keeps:
- every wait has a timeout (``spec.timeout_s``); a dead peer raises :class:`WeightSyncError`
  naming the peer and the bucket, never hangs;
- ``send_bucket`` may return before receivers are done (pipelining) but must not let the caller
  overwrite a buffer a receiver still reads;
- ``abort`` tells every receiver that the update is off, so they raise instead of waiting;
- ``cancel`` (from another thread) makes the half's current and next waits raise
  :class:`WeightSyncError` within a check interval (a closed session, an engine that refused).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ...errors import WeightSyncError
from ..buckets import BucketHeader
from ..manifest import TransportSpec, WeightManifest


class _Cancellable:
    cancelled: threading.Event
    cancel_reason: str = ""

    def cancel(self, reason: str) -> None:
        """Make this half's waits raise (thread-safe); ``cancelled.clear()`` re-arms it."""
        self.cancel_reason = reason
        self.cancelled.set()

    def raise_if_cancelled(self, bucket: int | None = None) -> None:
        if self.cancelled.is_set():
            raise WeightSyncError(f"weight transfer cancelled: {self.cancel_reason}", bucket=bucket)


class TransportSender(_Cancellable, abc.ABC):
    """Trainer-side half. One instance per weight-sync session."""

    name: ClassVar[str]
    #: Whether senders may reuse a buffer after send_bucket returns (True) or must hand over a
    #: fresh buffer each time (False, e.g. in-process queues that keep a reference).
    reuses_buffers: ClassVar[bool] = True
    #: Bucket size when the caller names none (``None``: the core's ``DEFAULT_BUCKET_BYTES``).
    default_bucket_bytes: ClassVar[int | None] = None

    def __init__(self, *, session_id: str, world_size: int, timeout_s: float, options: dict[str, Any]):
        self.session_id, self.world_size, self.timeout_s = session_id, world_size, timeout_s
        self.options = dict(options)
        self.cancelled = threading.Event()

    def spec_options(self) -> dict[str, Any]:
        """Options receivers need to connect (addresses, names, paths). JSON-serialisable."""
        return {}

    def connect(self) -> None:
        """Called after every receiver was told to connect (they connect concurrently)."""

    def device(self) -> torch.device:
        return torch.device("cpu")

    def begin(self, manifest: WeightManifest) -> None:
        """Called once per update before the first bucket."""

    def bucket_buffer(self, index: int, nbytes: int) -> torch.Tensor | None:
        """Optional: a uint8 buffer of at least ``nbytes`` that the transport owns (a shared-memory
        or IPC-shared slot) for bucket ``index``; the session packs into it and hands it back to
        :meth:`send_bucket`, saving a copy. ``None``: the session allocates its own buffers."""
        return None

    @abc.abstractmethod
    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None: ...

    def share_tensors(self, index: int, tensors: Sequence[torch.Tensor]) -> Any | None:
        """Optional zero-copy path: describe bucket ``index``'s tensors (in manifest order) so that
        receivers read them where they lie, or ``None`` to have the session pack them into a
        buffer and call :meth:`send_bucket` (the default)."""
        return None

    def send_shared(self, header: BucketHeader, shared: Any, tensors: Sequence[torch.Tensor]) -> None:
        """Publish a bucket described by :meth:`share_tensors`; the same pipelining rule as
        :meth:`send_bucket` (``tensors`` must stay untouched until receivers are done with them)."""
        raise NotImplementedError

    def end(self, manifest: WeightManifest) -> None:
        """Called once per update after the last bucket was sent."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None: ...

    def close(self) -> None:
        return None


class TransportReceiver(_Cancellable, abc.ABC):
    """Engine-worker-side half. One instance per worker and session."""

    name: ClassVar[str]

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        self.spec, self.rank, self.device = spec, rank, torch.device(device)
        self.timeout_s = spec.timeout_s
        self.cancelled = threading.Event()

    def connect(self) -> None:
        return None

    def begin(self, manifest: WeightManifest) -> None:
        return None

    @abc.abstractmethod
    def recv_bucket(self, index: int, nbytes: int) -> tuple[BucketHeader, torch.Tensor | list[torch.Tensor]]:
        """Block until bucket ``index`` arrives; return its header and a uint8 buffer that the
        caller owns until :meth:`release` (fresh or reused, see ``keeps_buffer``), or, for a bucket
        the sender shared without packing, one tensor per placement (the manifest's dtypes and
        shapes) that may be read until :meth:`release`."""

    def release(self, index: int) -> None:
        """The caller is done reading bucket ``index`` (lets the sender reuse its slot)."""

    def end(self, manifest: WeightManifest, ok: bool) -> None:
        return None

    def close(self) -> None:
        return None

    #: True when the buffer returned by recv_bucket stays valid after release (fresh memory);
    #: False when it is a shared slot that the sender overwrites (receiver must copy to keep it).
    keeps_buffer: ClassVar[bool] = True
    #: True when recv_bucket hands out the same few buffers (slots) push after push while the
    #: sender keeps them: the receiver may then keep its views of them for the next push.
    reuses_slots: ClassVar[bool] = False
