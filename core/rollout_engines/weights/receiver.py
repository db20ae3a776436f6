"""The engine-worker side of weight sync, shared by every backend and every transport.

A backend hosts one :class:`WeightReceiver` per worker and gives it a :class:`WeightTarget`
(what the model expects, and how to load tensors into it). The receiver does the rest:

1. validate the whole manifest against the model before anything is applied;
2. receive every bucket through the transport, verifying each bucket's checksum;
3. apply: ``staged`` mode keeps every bucket until all arrived and verified, then applies them
   in one go (an interrupted update changes nothing); ``inplace`` mode applies bucket by bucket
   (no second copy of the weights in memory) and, if the update fails midway, reports that the
   weights are invalid so the engine refuses to generate until the next complete push.

A receiver that rejects a manifest still drains the stream, so the group stays in step and the
next update works.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

import torch

from ..errors import ManifestMismatch, WeightsInvalidated, WeightSyncError
from .buckets import BucketHeader, BucketViews, bucket_views, checksum, checksum_tensors
from .delta import ReceivedBase, SparseRebuilder, check_base, current_reader, next_base
from .experts import ExpertSlice, alias_specs, expert_aliases
from .manifest import ExpectedSpec, TensorSpec, TransportSpec, WeightManifest, validate_manifest
from .transports.base import TransportReceiver

logger = logging.getLogger("rollout_engines.weights")

ApplyMode = Literal["staged", "inplace"]

#: Set to 1 in an engine's environment: CUDA receivers time their copies on the GPU (CUDA events
#: around each bucket's apply) and report ``gpu`` (first copy started to last copy done) and
#: ``gpu_busy`` (the sum over buckets) in their timings; ``gpu - gpu_busy`` is the GPU waiting.
TIMELINE_ENV = "ROLLOUT_ENGINES_PUSH_TIMELINE"


class WeightTarget(Protocol):
    """What a receiver needs from a model."""

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        """Name -> spec of every tensor an update may carry (HF checkpoint names)."""

    def apply(self, named: Sequence[tuple[str, torch.Tensor]], *, owned: bool) -> None:
        """Load these tensors. ``owned``: they are the target's to keep (no copy needed);
        otherwise they are views of a buffer the transport reuses and must be copied."""

    # Optional: ``current(name) -> torch.Tensor``, the model's tensor under ``name`` as it is now
    # (read only). Targets that have it take sparse delta pushes (see :mod:`.delta`).

    # Optional: ``apply_shared(index, placements, shared) -> bool``, for a bucket the sender shared
    # without packing whose views carry the sender's description (``cuda_ipc``'s
    # :class:`~.transports.cuda_ipc.SharedViews`): the target loads it some other way (e.g. hands
    # the description to another process that opens the same memory) and returns True, or returns
    # False and gets the views through ``apply``. Called in ``inplace`` mode only, for full
    # tensors (not a sparse delta's pieces), after the bucket's checksum was checked; the memory
    # may be read until the call returns.


def open_receiver(spec: TransportSpec, *, rank: int, device: torch.device | str) -> TransportReceiver:
    from ..plugins import get_registry

    cls = get_registry().transport(spec.transport).load_receiver()
    receiver = cls(spec, rank=rank, device=device)
    receiver.connect()
    return receiver


class WeightReceiver:
    """Receives versioned, validated, atomic updates into one worker's model."""

    def __init__(
        self,
        target: WeightTarget,
        *,
        device: torch.device | str = "cpu",
        mode: ApplyMode = "staged",
        label: str = "engine",
    ) -> None:
        self.target, self.device, self.mode, self.label = target, torch.device(device), mode, label
        self.transport: TransportReceiver | None = None
        self.version = 0
        #: Where the last update's time went (seconds): validate, wait (for buckets), check
        #: (checksums), apply (copies into the model), total; with :data:`TIMELINE_ENV` also gpu
        #: and gpu_busy. Benchmarks report it.
        self.last_timings: dict[str, float] = {}
        self._timeline = self.device.type == "cuda" and os.environ.get(TIMELINE_ENV) == "1"
        #: What the last validated manifest was checked as: its tensor list and the expected specs
        #: (by identity) and what else decides validity (partial, delta, sparse names).
        self._validated: tuple[object, object, tuple[object, ...]] | None = None
        #: The last complete state this receiver applied (version, fingerprints): what delta
        #: pushes are checked against (None: deltas are refused until a full push of a session
        #: that tracks its pushes). A host that swaps ``target`` for one update (a wrapper that
        #: applies to the same model) keeps the one given here for reading current values.
        self.delta_base: ReceivedBase | None = None
        self._home_target = target
        #: Views of the current layout's tensors in the transport's slots (a buffer it reuses).
        self._slot_views = BucketViews()

    def connect(self, spec: TransportSpec, local_rank: int = 0) -> None:
        self.close()
        self.delta_base = None
        self.transport = open_receiver(spec, rank=spec.rank_offset + local_rank, device=self.device)

    def cancel(self, reason: str) -> None:
        """Make a receive in progress (on another thread) raise :class:`WeightSyncError` within a
        check interval; nothing more of that update is applied (thread-safe)."""
        transport = self.transport
        if transport is not None:
            transport.cancel(reason)

    def receive(self, manifest: WeightManifest) -> int:
        """Receive one update. Raises WeightSyncError (ManifestMismatch, WeightsInvalidated, ...)."""
        self._receive_into(manifest, self.target, self.mode, model=True)
        self.version = manifest.version
        self.delta_base = next_base(manifest, self.delta_base)
        return self.version

    def receive_side(
        self, manifest: WeightManifest, target: WeightTarget, *, rejection: ManifestMismatch | None = None,
    ) -> None:
        """Receive one update into ``target``, which is not the model (a LoRA adapter, see
        :func:`rollout_engines.weights.lora.receive_lora`), through this receiver's session.

        The same validation (against ``target.expected_specs()``), checksums and draining as
        :meth:`receive`; buckets are handed to ``target`` as they arrive (it keeps what it needs).
        The receiver's ``version`` and delta base stay as they were, and a failure never marks
        the model's weights invalid. ``rejection``: refuse the update with this error (the stream
        is still drained, so the session stays in step)."""
        self._receive_into(manifest, target, "inplace", model=False, rejection=rejection)

    def _receive_into(
        self, manifest: WeightManifest, target: WeightTarget, mode: ApplyMode, *, model: bool,
        rejection: ManifestMismatch | None = None,
    ) -> None:
        if self.transport is None:
            raise WeightSyncError(f"{self.label}: no weight transfer initialised; call connect() first")
        transport = self.transport
        transport.raise_if_cancelled()
        clock = time.perf_counter
        start = clock()
        spent = dict.fromkeys(("validate", "wait", "wait_first", "check", "apply"), 0.0)
        expected = target.expected_specs()
        is_delta = manifest.delta is not None and manifest.delta.base_version is not None
        kind = (manifest.partial, is_delta, manifest.delta.sparse if manifest.delta is not None else ())
        cached = self._validated if model else None
        if rejection is None and (
            cached is None or cached[0] is not manifest.tensors or cached[1] is not expected or cached[2] != kind
        ):
            try:
                validate_manifest(manifest, expected)
                if model:  # a manifest copied from this one (same layout, next version) shares its lists
                    self._validated = (manifest.tensors, expected, kind)
            except ManifestMismatch as exc:
                rejection = exc
        current = current_reader(target, self._home_target) if model else None
        if rejection is None and is_delta:
            try:
                check_base(manifest, self.delta_base, current, self.label)
            except ManifestMismatch as exc:
                rejection = exc
        sparse = SparseRebuilder(manifest, current) if manifest.delta is not None and manifest.delta.sparse else None
        forward = getattr(target, "apply_shared", None)
        spent["validate"] = clock() - start
        transport.begin(manifest)
        staged: list[tuple[str, torch.Tensor]] = []
        applied_any = False
        ok = False
        events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        try:
            for bucket in manifest.buckets:
                t0 = clock()
                header, buf = transport.recv_bucket(bucket.index, bucket.nbytes)
                t1 = clock()
                spent["wait"] += t1 - t0
                if bucket.index == 0:
                    spent["wait_first"] = t1 - t0
                try:
                    self._check_header(manifest, bucket.index, header, buf)
                    t0 = clock()
                    spent["check"] += t0 - t1
                    if rejection is not None:
                        continue  # drain: stay in step with the sender and the other receivers
                    owned = transport.keeps_buffer
                    placements = manifest.bucket_tensors(bucket.index)
                    if isinstance(buf, list):  # shared without packing: views of the sender's tensors
                        views = [(p.name, t) for p, t in zip(placements, buf, strict=True)]
                        if mode == "staged" and not owned:
                            views, owned = [(n, t.clone()) for n, t in views], True
                    else:
                        if mode == "staged" and not owned:
                            buf, owned = buf.clone(), True
                        if owned or not transport.reuses_slots:
                            views = bucket_views(buf, placements)
                        else:
                            views = self._slot_views.get(manifest, bucket.index, buf)
                    rebuilt: list[tuple[str, torch.Tensor]] = []
                    if sparse is not None:  # a delta's pieces: whole tensors again (base + changes)
                        views, rebuilt = sparse.feed(views, owned=owned)
                    if mode == "inplace":
                        applied_any = True
                        if self._timeline:
                            events.append(_record_start())
                        if views and not (
                            forward is not None and sparse is None and hasattr(buf, "description")
                            and forward(bucket.index, placements, buf)
                        ):
                            target.apply(views, owned=owned)
                        if rebuilt:
                            target.apply(rebuilt, owned=True)
                        if self._timeline:
                            events[-1][1].record()
                    else:
                        staged.extend(views)
                        staged.extend(rebuilt)
                    spent["apply"] += clock() - t0
                finally:
                    transport.release(bucket.index)
            if rejection is not None:
                raise rejection
            if sparse is not None:
                sparse.finish()
            if mode == "staged":
                applied_any = True
                t0 = clock()
                if self._timeline:
                    events.append(_record_start())
                target.apply(staged, owned=True)
                if self._timeline:
                    events[-1][1].record()
                spent["apply"] += clock() - t0
            ok = True
        except WeightSyncError as exc:
            if applied_any and model:
                self.delta_base = None
                raise WeightsInvalidated(
                    f"{self.label}: update v{manifest.version} failed after some weights were applied "
                    f"({exc}); generation is refused until a complete push", peer=exc.peer, bucket=exc.bucket
                ) from exc
            raise
        except Exception as exc:
            invalid = applied_any and model
            err_cls = WeightsInvalidated if invalid else WeightSyncError
            if invalid:
                self.delta_base = None
            raise err_cls(f"{self.label}: update v{manifest.version} failed: {exc!r}{_advice(exc)}") from exc
        finally:
            if not ok:  # the transport may close its slots now: let go of their views
                self._slot_views.clear()
            transport.end(manifest, ok)
        spent["total"] = clock() - start
        if events:
            events[-1][1].synchronize()
            spent["gpu"] = events[0][0].elapsed_time(events[-1][1]) / 1e3
            spent["gpu_busy"] = sum(a.elapsed_time(b) for a, b in events) / 1e3
        self.last_timings = {k: round(v, 6) for k, v in spent.items()}

    def _check_header(
        self, manifest: WeightManifest, index: int, header: BucketHeader, buf: torch.Tensor | list[torch.Tensor]
    ) -> None:
        if header.status == BucketHeader.ABORT:
            raise WeightSyncError(
                f"{self.label}: the sender aborted update v{manifest.version}: {header.reason}",
                peer="trainer", bucket=header.index,
            )
        if header.index != index:
            raise WeightSyncError(
                f"{self.label}: got bucket {header.index} of update v{manifest.version} where bucket {index} "
                "was due; the transport mixed buckets up, nothing more of this update is applied",
                peer="trainer", bucket=index,
            )
        expected = manifest.buckets[index].nbytes
        if header.nbytes != expected or (not isinstance(buf, list) and buf.numel() < expected):
            raise WeightSyncError(
                f"{self.label}: bucket size {header.nbytes} does not match the manifest's {expected}",
                peer="trainer", bucket=header.index,
            )
        if isinstance(buf, list):
            got = checksum_tensors(buf, manifest.checksum)
        else:
            got = checksum(buf[: header.nbytes], manifest.checksum)
        if got != header.checksum:
            raise WeightSyncError(
                f"{self.label}: checksum mismatch in update v{manifest.version} "
                f"(got {got}, sender said {header.checksum}); the data was corrupted or mixed",
                peer="trainer", bucket=header.index,
            )

    def close(self) -> None:
        self._slot_views.clear()
        if self.transport is not None:
            try:
                self.transport.close()
            finally:
                self.transport = None


def _record_start() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


class StateDictTarget:
    """A :class:`WeightTarget` over a ``torch.nn.Module``'s state dict.

    Applying swaps each parameter's storage for the received tensor where the tensor is owned and
    dtype and device match (no copy; the old storage is freed), and copies otherwise. A
    transformers model that fuses experts on load (transformers 5 MoE) takes them under its
    checkpoint's names, one tensor per expert and projection, as vLLM and SGLang do
    (:mod:`.experts`); each is copied into its slice of the fused parameter.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._specs: dict[str, TensorSpec] | None = None
        self._params: dict[str, torch.Tensor] | None = None
        self._aliases: dict[str, ExpertSlice] | None = None

    def current(self, name: str) -> torch.Tensor:
        """The module's tensor under ``name`` as it is now (for sparse delta pushes; read only)."""
        if self._params is None:  # parameters keep their objects when their storage is swapped
            self._params = self.module.state_dict(keep_vars=True)
        alias = self._aliases.get(name) if self._aliases else None
        if alias is not None:
            return alias.of(self._params[alias.param].detach())
        return self._params[name].detach()

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        """Every name of the state dict (a fused expert parameter: its checkpoint names instead);
        tied parameters (one tensor under several names, e.g. an embedding shared with the LM head)
        name each other in ``tied_to``."""
        if self._specs is None:
            state = self.module.state_dict(keep_vars=True)
            self._aliases = expert_aliases(self.module)
            fused = {a.param for a in self._aliases.values()} if self._aliases else set()
            names_of: dict[int, list[str]] = {}
            for name, t in state.items():
                names_of.setdefault(id(t), []).append(name)
            self._specs = {
                name: ExpectedSpec(
                    name=name, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                    tied_to=tuple(n for n in names_of[id(t)] if n != name),
                )
                for name, t in state.items() if name not in fused
            }
            for name, (shape, dtype) in alias_specs(self._aliases or {}, state).items():
                self._specs[name] = ExpectedSpec(name=name, dtype=str(dtype).removeprefix("torch."), shape=shape)
        return self._specs

    def apply(self, named: Sequence[tuple[str, torch.Tensor]], *, owned: bool) -> None:
        params = self.module.state_dict(keep_vars=True)
        aliases = self._aliases or {}
        with torch.no_grad():
            for name, tensor in named:
                alias = aliases.get(name)
                if alias is not None:  # a slice of a fused parameter
                    alias.of(params[alias.param].data).copy_(tensor)
                    continue
                dst = params[name]
                if owned and tensor.device == dst.device and tensor.dtype == dst.dtype:
                    dst.data = tensor
                else:
                    dst.data.copy_(tensor)


def _advice(exc: BaseException) -> str:
    """What to do next, for failures whose fix is the caller's: a device out of memory while
    receiving (the engine took the GPU up to its memory fraction, the trainer's tensors sit beside
    it, and an update needs room for its buffers)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return ("; the engine's device ran out of memory while receiving: leave room beside the engine for "
                "the trainer's tensors and the update's buffers (a lower memory fraction: vLLM's "
                "gpu_memory_utilization or kv_cache_memory_bytes, SGLang's mem_fraction_static)")
    return ""
