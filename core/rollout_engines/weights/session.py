"""The trainer side of weight sync: connect to engines once, push versioned updates, close.

    sync = await connect_weight_sync(engines, transport="gloo")
    await sync.push(model.state_dict().items(), version=step)
    await sync.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import uuid
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from ..errors import (
    CapabilityError,
    EngineAsleep,
    EngineClosed,
    ManifestMismatch,
    StaleVersion,
    UpdateRefused,
    WeightSyncError,
)
from ..types import LoraSpec
from .buckets import (
    BucketHeader,
    BucketViews,
    alloc_bucket,
    check_bucket_tensors,
    checksum,
    checksum_tensors,
    expected_tensors,
    pack_bucket,
)
from .delta import DeltaBaseMismatch, DeltaPlan, DeltaTracker
from .fp8 import Quantization
from .manifest import (
    DEFAULT_BUCKET_BYTES,
    ChecksumKind,
    DeltaSpec,
    TensorSpec,
    TransportSpec,
    WeightManifest,
    check_timeout,
    plan_manifest,
    specs_of,
)
from .transports.base import TransportSender

if TYPE_CHECKING:
    from ..engine import EngineProtocol

logger = logging.getLogger("rollout_engines.weights")

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


async def connect_weight_sync(
    engines: Sequence[EngineProtocol],
    transport: str = "inproc",
    *,
    bucket_bytes: int | None = None,
    timeout_s: float = 300.0,
    checksum: ChecksumKind = "pos64",
    options: dict[str, Any] | None = None,
    progress: bool | None = None,
    delta: bool = False,
    delta_device: torch.device | str | None = None,
) -> WeightSync:
    """Open a weight-sync session from this (trainer) process to every engine.

    Each engine's workers get their rank in the session (the trainer is rank 0); engines that
    cannot receive over ``transport`` fail here with a :class:`CapabilityError`, at once, before
    anything waits. ``timeout_s`` bounds every wait of the session (at most ``MAX_TIMEOUT_S``).
    ``delta``: pushes send only what changed since the last complete one (:mod:`.delta`; the
    session keeps a copy of the weights last sent, on each tensor's device or ``delta_device``).
    """
    from ..plugins import get_registry

    if not engines:
        raise ValueError("connect_weight_sync needs at least one engine")
    check_timeout(timeout_s)
    for engine in engines:
        if transport not in engine.capabilities.transports:
            raise CapabilityError(
                f"backend '{engine.backend_name}' cannot receive weights over '{transport}'; "
                f"it supports: {', '.join(engine.capabilities.transports) or 'none'}"
            )
    sender_cls = get_registry().transport(transport).load_sender()
    if bucket_bytes is None:  # the transport's own best size, else the core's
        bucket_bytes = sender_cls.default_bucket_bytes or DEFAULT_BUCKET_BYTES
    counts = [engine.weight_receivers() for engine in engines]
    world_size = 1 + sum(counts)
    session_id = uuid.uuid4().hex[:16]
    sender = sender_cls(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options or {})
    spec_options = sender.spec_options()
    offsets = [1 + sum(counts[:i]) for i in range(len(engines))]
    specs = [
        TransportSpec(
            transport=transport, session_id=session_id, rank_offset=off, world_size=world_size,
            timeout_s=timeout_s, options=spec_options,
        )
        for off in offsets
    ]
    connect = asyncio.ensure_future(asyncio.to_thread(sender.connect))
    joins = [asyncio.ensure_future(e.init_weight_transfer(s)) for e, s in zip(engines, specs, strict=True)]
    errors = await _gather_cancelling(sender, connect, joins)
    if errors:
        # The engines that did join leave the session again: none keeps a receiver (its store
        # connection, heartbeat thread, shared memory) for a session that never started.
        joined = [e for e, j in zip(engines, joins, strict=True) if not j.cancelled() and j.exception() is None]
        await asyncio.gather(*(e.close_weight_transfer() for e in joined), return_exceptions=True)
        await asyncio.to_thread(sender.close)
        # An engine's refusal says why; the sender's wait it cancelled does not.
        first = next((e for e in errors if isinstance(e, _REFUSALS)), errors[0])
        if isinstance(first, WeightSyncError | NotImplementedError):
            raise first
        raise WeightSyncError(f"could not connect the '{transport}' weight sync: {first!r}") from first
    return WeightSync(
        list(engines), sender, transport=transport, bucket_bytes=bucket_bytes, timeout_s=timeout_s,
        checksum=checksum, progress=progress, delta=delta, delta_device=delta_device,
    )


class WeightSync:
    """A connected weight-sync session. Use :meth:`push` for every update, then :meth:`close`."""

    def __init__(
        self,
        engines: list[EngineProtocol],
        sender: TransportSender,
        *,
        transport: str,
        bucket_bytes: int,
        timeout_s: float,
        checksum: ChecksumKind,
        progress: bool | None,
        delta: bool = False,
        delta_device: torch.device | str | None = None,
    ) -> None:
        self.engines, self.sender, self.transport = engines, sender, transport
        self.bucket_bytes, self.timeout_s, self.checksum = bucket_bytes, timeout_s, checksum
        self.progress = progress
        self.version: int | None = None
        self.last_push_seconds = 0.0
        #: The trainer's side of the last push, in seconds from its start: ``begin`` (the sender
        #: began, once the engines' receives started), ``first_bucket`` (the first bucket
        #: published, or packed and sent) and ``stream`` (the last one, and the sender done:
        #: acknowledgements it waits for included).
        self.last_send_timings: dict[str, float] = {}
        #: Bytes of the last push's buckets (what crossed to each receiver, alignment included)
        #: and of every tensor it stands for (what a full push carries); equal but for padding
        #: unless the push was a delta.
        self.last_push_bytes = 0
        self.last_push_model_bytes = 0
        #: The default of ``push(delta=...)``; the record of the last complete update, once tracking.
        self.delta = delta
        self.delta_device = delta_device
        self._tracker: DeltaTracker | None = None
        self._closed = False
        self._layout: tuple[tuple[Any, ...], WeightManifest] | None = None
        #: Per bucket of the current layout: each tensor's name, dtype and shape, as torch objects.
        self._expected: dict[int, list[tuple[str, torch.dtype, tuple[int, ...]]]] = {}
        #: Views of the current layout's tensors in the transport's own slots (packed transports).
        self._slot_views = BucketViews()
        self._send_error: BaseException | None = None
        self._in_flight = False
        self._names: tuple[object, frozenset[str]] | None = None

    async def push(
        self,
        tensors: NamedTensors,
        *,
        version: int,
        specs: Sequence[TensorSpec] | None = None,
        partial: bool = False,
        allow_rollback: bool = False,
        delta: bool | None = None,
        quantize: Quantization | None = None,
    ) -> int:
        """Send one complete update to every engine; returns ``version`` once all applied it.

        ``tensors`` is a mapping or an iterable of ``(name, tensor)``. With ``specs`` (name, dtype and
        shape of every tensor, in order) the iterable is consumed lazily, one bucket at a time, so a
        generator that gathers FSDP shards never holds more than a bucket. Without ``specs`` the
        iterable is listed first (references only).

        Strict by default: every tensor the engines expect must be there (``partial=True`` to send
        some), and ``version`` must be above every engine's (``allow_rollback=True`` to go back).
        Raises :class:`ManifestMismatch` (names, shapes, dtypes, completeness; :class:`StaleVersion`)
        with nothing applied, or :class:`WeightSyncError` (and subclasses) for what failed in flight.

        ``delta`` (default: the session's ``delta``): send only the tensors that changed since the
        last complete update of this weight sync, sparse where smaller (:mod:`.delta`); the first push,
        and the one after any failure or refusal (:class:`~.delta.DeltaBaseMismatch`), is full.
        ``delta=False`` always sends everything (and, once the session tracks, records it as the base).

        ``quantize="fp8_block"``: quantize here, on the tensors' own device, before bucketing, for
        engines that serve an FP8 block copy (:mod:`.fp8`): each quantized ``x.weight`` travels as
        float8_e4m3fn plus ``x.weight_scale_inv``, half the bytes. Without it such engines quantize
        the BF16 tensors in their workers. Not combined with ``delta``.

        One push at a time per session (another one while a push is in flight raises
        :class:`WeightSyncError`). Cancelling the call (``asyncio.wait_for``, ``task.cancel()``)
        aborts the update where it has not finished: the engines' receives raise, so an engine that
        had not applied it stays on its previous weights (one applying in place refuses generation
        until a complete push, as after any failure in flight); the cancellation returns once the
        sender and every engine are done with the update (bounded by the session's timeout), and
        the next delta push is full.
        """
        with self._exclusive():
            return await self._push(tensors, version=version, specs=specs, partial=partial,
                                    allow_rollback=allow_rollback, delta=delta, quantize=quantize)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        if self._closed:
            raise WeightSyncError("this weight sync session is closed; connect a new one")
        if self._in_flight:
            raise WeightSyncError(
                "a push is already in flight on this weight sync session; await it before the next one"
            )
        self._in_flight = True
        try:
            yield
        finally:
            self._in_flight = False

    async def _push(
        self, tensors: NamedTensors, *, version: int, specs: Sequence[TensorSpec] | None, partial: bool,
        allow_rollback: bool, delta: bool | None, quantize: Quantization | None,
    ) -> int:
        if not allow_rollback:
            behind = [(e.backend_name, e.weight_version) for e in self.engines if e.weight_version >= version]
            if behind:
                raise StaleVersion(
                    f"weight update v{version} is not newer than the engines' weights "
                    f"({', '.join(f'{n}: v{v}' for n, v in behind[:4])}); push a higher version, "
                    "or pass allow_rollback=True to go back on purpose"
                )
        items: Iterable[tuple[str, torch.Tensor]] = tensors.items() if isinstance(tensors, Mapping) else tensors
        plan: DeltaPlan | None = None
        if delta is None:
            delta = self.delta
        if quantize is not None:
            from .fp8 import quantize_named, quantized_specs

            if quantize != "fp8_block":
                raise ValueError(f"quantize={quantize!r}: the one format is 'fp8_block'")
            if delta or self._tracker is not None:
                raise ValueError("quantize= is not combined with delta pushes; connect without delta=True")
            items = quantize_named(items)
            if specs is not None:
                specs = quantized_specs(specs)
        if delta and self._tracker is None:
            sparse_ok = self.transport not in _WHOLE_ONLY
            self._tracker = DeltaTracker(device=self.delta_device, sparse=sparse_ok)
        if self._tracker is not None:
            tracker = self._tracker
            if delta and tracker.version is not None:
                moved = [e for e in self.engines if e.weight_version != tracker.version]
                if moved:  # an engine moved on another way (restarted, rejoined): no common base
                    logger.info("push v%d: %s is on v%d, not the delta base v%d; sending a full update",
                                version, moved[0].backend_name, moved[0].weight_version, tracker.version)
                    delta = False
            plan = await asyncio.to_thread(tracker.plan, list(items), delta=bool(delta), partial=partial)
            items, specs = plan.items, None
        manifest, items = self._manifest(items, specs, version, partial=partial, allow_rollback=allow_rollback,
                                         delta=plan.spec if plan is not None else None)
        plan_failed = await self._send(manifest, items)
        if plan_failed is not None and self._tracker is not None:
            self._tracker.invalidate()  # the engines' states are not known alike: the next push is full
            if any(getattr(r, "sparse_unsupported", False) for _, r in plan_failed):
                self._tracker.sparse = False
        self._raise_failures(version, plan_failed)
        self.version = version
        self.last_push_bytes = sum(b.nbytes for b in manifest.buckets)
        self.last_push_model_bytes = plan.model_bytes if plan is not None else manifest.total_bytes
        if plan is not None and self._tracker is not None:
            await asyncio.to_thread(self._tracker.commit, plan, version=version, partial=partial)
        logger.info(
            "pushed v%d: %.1f MB in %.3f s over %s to %d engine(s)%s", version, self.last_push_bytes / 1e6,
            self.last_push_seconds, self.transport, len(self.engines),
            f" (delta: {len(plan.skipped)} unchanged, {len(plan.sparse)} sparse, of "
            f"{self.last_push_model_bytes / 1e6:.1f} MB)" if plan is not None and plan.spec.base_version is not None else "",
        )
        return version

    async def push_lora(
        self, adapter: LoraSpec, tensors: NamedTensors, *, version: int, allow_rollback: bool = False,
    ) -> int:
        """Send the LoRA adapter ``adapter`` (its ``lora_A``/``lora_B`` tensors, named as PEFT saves
        them) to every engine, which installs it atomically under ``adapter.name`` once all of it
        arrived and checked; requests then select it with ``GenerateRequest.lora``. ``version`` is
        the adapter's own (it must increase per adapter unless ``allow_rollback``); the base weights
        and their version are untouched. Raises :class:`ManifestMismatch` (a module the model lacks,
        a shape that does not fit the rank, a rank above the engine's) with nothing installed."""
        with self._exclusive():
            unable = [e.backend_name for e in self.engines if not e.capabilities.lora]
            if unable:  # before anything is sent: the session stays usable for full pushes
                raise CapabilityError(
                    f"engine(s) {unable} of this weight sync cannot load LoRA adapters (capability 'lora')"
                )
            manifest, items = self._manifest(tensors.items() if isinstance(tensors, Mapping) else tensors, None,
                                             version, allow_rollback=allow_rollback, lora=adapter)
            self._raise_failures(version, await self._send(manifest, items), what=f"LoRA '{adapter.name}' ")
        logger.info("pushed LoRA '%s' v%d (rank %d): %.1f MB in %.3f s to %d engine(s)", adapter.name, version,
                    adapter.rank, manifest.total_bytes / 1e6, self.last_push_seconds, len(self.engines))
        return version

    def _manifest(
        self, items: Iterable[tuple[str, torch.Tensor]], specs: Sequence[TensorSpec] | None, version: int, *,
        partial: bool = False, allow_rollback: bool = False, delta: DeltaSpec | None = None, lora: LoraSpec | None = None,
    ) -> tuple[WeightManifest, Iterable[tuple[str, torch.Tensor]]]:
        """The manifest of update ``version`` of ``items`` (described by ``specs``, or by the tensors
        themselves), and the items (listed where they were a one-pass iterable). The same tensors as
        the last update (names, dtypes, shapes): the same layout with the new version and flags,
        without planning and validating it again (milliseconds for a few hundred tensors, every
        push; a copy costs microseconds)."""
        if specs is None:
            if not isinstance(items, Collection):  # a generator: listed (references only)
                items = list(items)
            listed: Collection[tuple[str, torch.Tensor]] = items
            count = len(listed)

            def rows() -> Iterator[tuple[Any, ...]]:
                return ((n, t.dtype, t.shape) for n, t in listed)
        else:
            described, count = specs, len(specs)

            def rows() -> Iterator[tuple[Any, ...]]:
                return ((s.name, s.dtype, s.shape) for s in described)
        flags: dict[str, Any] = {"partial": partial, "allow_rollback": allow_rollback, "delta": delta, "lora": lora}
        # Compared row by row, each row freed at once: a push keeps no object per tensor alive (a
        # kept key per push, ~10k tuples for a MoE model, set off Python's full collections, each
        # a pause of tens of milliseconds, every few pushes). A mapping's items are read twice.
        layout = self._layout
        if layout is not None and len(layout[0]) == count and all(a == b for a, b in zip(layout[0], rows(), strict=True)):
            manifest = layout[1].model_copy(update={"version": version, "session_id": uuid.uuid4().hex, **flags})
        else:
            if specs is None:
                specs = specs_of(listed)
            manifest = plan_manifest(
                specs, version=version, bucket_bytes=self.bucket_bytes, transport=self.transport,
                timeout_s=self.timeout_s, checksum=self.checksum, **flags,
            )
            self._layout = (tuple(rows()), manifest)
            self._expected = {}
            self._slot_views.clear()
        return manifest, items

    async def _send(
        self, manifest: WeightManifest, items: Iterable[tuple[str, torch.Tensor]],
    ) -> list[tuple[int, BaseException]] | None:
        """Stream ``items`` as ``manifest`` lays them out while every engine receives; returns the
        engines' failures (a failed send alone counts as ``[]``), or None when all applied it."""
        start = time.perf_counter()
        self.sender.cancelled.clear()
        # The sender's thread is started first but begins once every engine's receive took its
        # first step (the loop runs them in order, then sets the event): that step hands the
        # manifest on (an engine's RPC, a doorbell's store writes), which ran several times slower
        # beside the sender's thread holding the GIL, while the receivers only wait for bucket 0
        # anyway (benchmarks/RESULTS.md, the push's timeline). The wait is bounded: a receive that
        # blocks the loop cannot stall the sender.
        receivers_started = threading.Event()
        sending = asyncio.ensure_future(
            asyncio.to_thread(self._stream, manifest, iter(items), start, receivers_started)
        )
        receivers = [asyncio.ensure_future(e.receive_weights(manifest)) for e in self.engines]
        asyncio.get_running_loop().call_soon(receivers_started.set)
        try:
            await _gather_cancelling(self.sender, sending, receivers)
        except asyncio.CancelledError:
            await self._abandon(manifest, sending, receivers)
            raise
        self.last_push_seconds = time.perf_counter() - start
        self._send_error = sending.exception()
        failures = [(i, r) for i, r in enumerate(r.exception() for r in receivers) if r is not None]
        return failures if failures or self._send_error is not None else None

    async def _abandon(
        self, manifest: WeightManifest, sending: asyncio.Future[Any], receivers: Sequence[asyncio.Future[Any]]
    ) -> None:
        """The caller cancelled the push: the sender stops at its next bucket or wait and aborts the
        update, so the engines' receives raise instead of applying the rest; then wait (bounded)
        until the sender's thread and every engine are done with it, so nothing of it runs beside
        the next push."""
        self.sender.cancel(f"push v{manifest.version} was cancelled by its caller")
        if self._tracker is not None:
            self._tracker.invalidate()  # whether the engines applied it is not known alike
        futures = [sending, *receivers]
        pending = [f for f in futures if not f.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.timeout_s)
            if late:
                logger.warning("push v%d was cancelled; %d of its parts did not finish within %.0f s",
                               manifest.version, len(late), self.timeout_s)
        for f in futures:  # their errors are the cancellation's consequence, not news
            if f.done() and not f.cancelled():
                f.exception()

    def _raise_failures(self, version: int, failures: list[tuple[int, BaseException]] | None, what: str = "") -> None:
        send_error, self._send_error = self._send_error, None
        if failures is not None:
            parts = []
            if send_error is not None and not (failures and self.sender.cancelled.is_set()):
                parts.append(f"sender: {send_error}")
            parts += [f"engine {i} ({self.engines[i].backend_name}): {r}" for i, r in failures]
            causes: list[BaseException] = [r for _, r in failures] or [send_error]  # type: ignore[list-item]
            first = causes[0]
            # The most specific type every cause shares: a refused manifest stays a ManifestMismatch.
            kind: type[WeightSyncError] = WeightSyncError
            for candidate in (StaleVersion, DeltaBaseMismatch, ManifestMismatch):
                if all(isinstance(c, candidate) for c in causes):
                    kind = candidate
                    break
            else:
                if isinstance(first, WeightSyncError) and all(type(c) is type(first) for c in causes):
                    kind = type(first)
            err = kind(f"{what}weight update v{version} failed: " + " | ".join(parts))
            err.failures = failures  # type: ignore[attr-defined]
            raise err from first

    def _stream(
        self, manifest: WeightManifest, items: Iterator[tuple[str, torch.Tensor]], start: float | None = None,
        after: threading.Event | None = None,
    ) -> None:
        sender = self.sender
        clock = time.perf_counter
        start = clock() if start is None else start
        timings = self.last_send_timings = {}
        if after is not None:
            after.wait(SENDER_START_WAIT_S)
            timings["begin"] = round(clock() - start, 6)
        device = sender.device()
        slots: list[torch.Tensor] = []
        show = self.progress if self.progress is not None else (sys.stderr.isatty() and manifest.total_bytes > 2**28)
        bar = _progress(show, manifest.total_bytes, f"push v{manifest.version} ({self.transport})")
        try:
            sender.begin(manifest)
            pending: dict[str, torch.Tensor] = {}
            known, taken = self._names_of(manifest), set()
            with bar as advance:
                for bucket in manifest.buckets:
                    sender.raise_if_cancelled(bucket.index)  # the caller gave up, or an engine refused
                    names = [manifest.tensors[i].name for i in bucket.tensors]
                    missing = {n for n in names if n not in pending}  # a set: buckets of thousands of tensors (MoE)
                    while missing:
                        try:
                            name, tensor = next(items)
                        except StopIteration:
                            first = next(n for n in names if n in missing)
                            raise WeightSyncError(
                                f"the tensor iterator ended before '{first}' (named in the specs)",
                                bucket=bucket.index,
                            ) from None
                        if name in taken or name not in known:
                            raise WeightSyncError(
                                f"the tensor iterator gave '{name}' "
                                + ("twice" if name in taken else "which the specs do not name")
                                + "; with specs= it must yield each tensor the specs name once, in order",
                                bucket=bucket.index,
                            )
                        taken.add(name)
                        pending[name] = tensor  # not detached: a new tensor would hide who else holds it
                        missing.discard(name)
                    srcs = [pending[n] for n in names]
                    shared = sender.share_tensors(bucket.index, srcs)
                    if shared is not None:  # receivers read the tensors where they lie: no packing
                        expected = self._expected.get(bucket.index)
                        if expected is None:
                            expected = self._expected[bucket.index] = expected_tensors(manifest, bucket.index)
                        check_bucket_tensors(expected, srcs)
                        header = BucketHeader(
                            index=bucket.index, nbytes=bucket.nbytes,
                            checksum=checksum_tensors(srcs, manifest.checksum),
                        )
                        sender.send_shared(header, shared, srcs)
                        timings.setdefault("first_bucket", round(clock() - start, 6))
                        for n in names:
                            del pending[n]
                        del srcs
                        advance(bucket.nbytes)
                        continue
                    del srcs
                    own = sender.bucket_buffer(bucket.index, bucket.nbytes) if sender.reuses_buffers else None
                    if own is not None:
                        out = own  # the transport's own slot (shared memory, IPC-shared): no extra copy
                    elif sender.reuses_buffers:
                        slot = bucket.index % 2
                        if len(slots) <= slot or slots[slot].numel() < bucket.nbytes:
                            size = max(bucket.nbytes, min(self.bucket_bytes, manifest.total_bytes))
                            buf = alloc_bucket(size, device)
                            slots[slot:slot + 1] = [buf]
                        out = slots[slot]
                    else:
                        out = alloc_bucket(bucket.nbytes, device)
                    with torch.no_grad():
                        # Only a transport's slot stays from push to push; the views of ours would hold it.
                        kept = self._slot_views if own is not None else None
                        buf = pack_bucket(manifest, bucket.index, pending, out, kept)
                    for n in names:
                        del pending[n]
                    header = BucketHeader(
                        index=bucket.index, nbytes=bucket.nbytes, checksum=checksum(buf, manifest.checksum)
                    )
                    sender.send_bucket(header, buf)
                    timings.setdefault("first_bucket", round(clock() - start, 6))
                    advance(bucket.nbytes)
            sender.end(manifest)
            timings["stream"] = round(clock() - start, 6)
        except BaseException as exc:
            try:
                sender.abort(f"{type(exc).__name__}: {exc}")
            except Exception:  # the peer may be gone already; the original error matters
                logger.debug("abort after failure also failed", exc_info=True)
            raise

    def _names_of(self, manifest: WeightManifest) -> frozenset[str]:
        """The names ``manifest`` carries (kept while the layout stays: its tensor list is shared)."""
        if self._names is None or self._names[0] is not manifest.tensors:
            self._names = (manifest.tensors, frozenset(t.name for t in manifest.tensors))
        return self._names[1]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(e.close_weight_transfer() for e in self.engines), return_exceptions=True)
        self._slot_views.clear()  # views of the slots the sender is about to close
        await asyncio.to_thread(self.sender.close)

    async def __aenter__(self) -> WeightSync:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


#: The longest a push's sender waits for the engines' receives to take their first step (they
#: normally do within a fraction of a millisecond; a receive that blocks the event loop instead
#: costs this much, not the push).
SENDER_START_WAIT_S = 0.005

#: Transports that send changed tensors whole in a delta push (no sparse pieces): zero-copy
#: ``cuda_ipc`` maps the trainer's own allocations, and new index/value tensors every push would
#: be new allocations to share; on one GPU skipping unchanged tensors is what saves time.
_WHOLE_ONLY = frozenset({"cuda_ipc"})

#: Errors an engine raises before it reads any of an update (nothing will drain the stream).
_REFUSALS = (StaleVersion, UpdateRefused, CapabilityError, EngineAsleep, EngineClosed)


async def _gather_cancelling(
    sender: TransportSender, sending: asyncio.Future[Any], receivers: Sequence[asyncio.Future[Any]]
) -> list[BaseException]:
    """Wait for the sender's thread and every engine; an engine that refuses before it reads
    anything (a stale version, an undeclared capability, asleep or closed) cancels the sender's
    waits at once instead of leaving it to wait for acknowledgements until its timeout (an engine
    that fails mid-stream is named by the sender's own liveness checks). Returns the errors."""
    pending = {sending, *receivers}
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        refused = [f.exception() for f in done if f is not sending and isinstance(f.exception(), _REFUSALS)]
        if refused and not sending.done():
            sender.cancel(f"an engine refused: {refused[0]}")
    errors = [f.exception() for f in (sending, *receivers)]
    return [e for e in errors if e is not None]


class _progress:
    """A rich progress bar over bytes, or nothing when not wanted (not a terminal, small push)."""

    def __init__(self, show: bool, total: int, label: str) -> None:
        self.show, self.total, self.label = show, total, label
        self._cm: Any = nullcontext()
        self._lock = threading.Lock()

    def __enter__(self):  # type: ignore[no-untyped-def]
        if not self.show:
            return lambda n: None
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        self._cm = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), transient=True)
        progress = self._cm.__enter__()
        task = progress.add_task(self.label, total=self.total)
        return lambda n: progress.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)
