"""Delta pushes: send only what changed since the session's last complete update.

    sync = await connect_weight_sync(engines, transport="http", delta=True)
    await sync.push(model.state_dict(), version=1)   # full: starts the chain
    await sync.push(model.state_dict(), version=2)   # only what changed since v1

Trainer side (:class:`DeltaTracker`, kept by the :class:`~.session.WeightSync`): a copy of every
tensor as last sent in an update every engine applied (memory: one more copy of the weights, on
each tensor's own device unless ``delta_device`` says otherwise, e.g. ``"cpu"``), and the ``pos64``
fingerprint of each. A delta push compares every tensor bit for bit with its copy: identical ones
are not sent at all; a changed one goes whole, or as a sparse pair (``name#idx``: flat indices,
int32 or int64; ``name#val``: the new values) when that is smaller. The manifest names the base
(its version and a digest of its fingerprints); every tensor the update changes carries its new
fingerprint. A delta consumes the tensor iterable up front (the lazy ``specs=`` streaming of a full
push does not apply), since what is sent depends on every tensor's comparison.

Receiver side (:class:`~.receiver.WeightReceiver`): it keeps the version and fingerprints of the
last complete state it applied (from full pushes of a tracking session, and updated by every delta).
A delta whose base version or digest differs, or whose sparse tensors' current values do not have
the recorded fingerprint (weights changed behind the receiver's back), is refused with
:class:`DeltaBaseMismatch` before anything is applied, and the stream is drained as for every
refusal. Sparse pieces need the target's current values (``WeightTarget.current(name)``); a target
without it refuses sparse deltas (``sparse_unsupported``), and the session then sends changed
tensors whole. After a refusal or failure the session's next push is a full one by itself; a full
push (``push(..., delta=False)``) is always possible.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import ManifestMismatch
from .buckets import checksum
from .manifest import ALIGN, SPARSE_INDEX, SPARSE_VALUE, DeltaSpec, WeightManifest

Named = list[tuple[str, torch.Tensor]]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaBaseMismatch(ManifestMismatch):
    """A delta push met an engine that is not on its base (another version, other weights, or a
    target that cannot take sparse deltas: ``sparse_unsupported``); nothing was applied. Push a full
    update (the session's next push is one by itself)."""

    sparse_unsupported: bool = False


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (bit-exact comparisons: NaNs, signed zeros)."""
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.dtype not in _INT_OF_SIZE.values() else t


def fingerprint(t: torch.Tensor) -> int:
    """The ``pos64`` checksum of a tensor's bytes (its value, in row-major order)."""
    flat = t.detach().contiguous().reshape(-1)
    return checksum(flat.view(torch.uint8), "pos64")


def digest(fingerprints: Mapping[str, int]) -> str:
    """One digest over every tensor's fingerprint (what a delta names as its base)."""
    h = hashlib.sha256()
    for name in sorted(fingerprints):
        h.update(f"{name}\0{fingerprints[name]}\n".encode())
    return h.hexdigest()[:32]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class DeltaPlan:
    """What one push sends: ``items`` (in order; sparse tensors as their two pieces), its
    :class:`DeltaSpec`, and what the tracker records once every engine applied it."""

    items: Named
    spec: DeltaSpec
    model_bytes: int  # bytes of every tensor of the push, sent or not (a full push's payload)
    skipped: list[str] = field(default_factory=list)
    sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    whole: dict[str, torch.Tensor] = field(default_factory=dict)


class DeltaTracker:
    """The trainer's record of the last complete update (see the module docstring)."""

    def __init__(self, *, device: torch.device | str | None = None, sparse: bool = True) -> None:
        self.device = torch.device(device) if device is not None else None
        self.sparse = sparse
        self.version: int | None = None
        self.base: dict[str, torch.Tensor] = {}
        self.fingerprints: dict[str, int] = {}

    def invalidate(self) -> None:
        """The engines' state is no longer known: the next push is a full one (copies are reused)."""
        self.version = None

    def plan(self, items: Sequence[tuple[str, torch.Tensor]], *, delta: bool, partial: bool) -> DeltaPlan:
        """Compare ``items`` with the base (``delta``, when there is one) and decide what to send."""
        names = [n for n, _ in items]
        model_bytes = sum(t.numel() * t.element_size() for _, t in items)
        use_base = delta and self.version is not None
        if use_base and not partial and set(names) != set(self.fingerprints):
            use_base = False  # another set of tensors than the base: a full push says what is missing
        send: Named = []
        plan = DeltaPlan(items=send, spec=DeltaSpec(), model_bytes=model_bytes)
        fps: dict[str, int] = {}
        with torch.no_grad():
            for name, t in items:
                base = self.base.get(name) if use_base else None
                if (base is not None and base.dtype == t.dtype and base.shape == t.shape
                        and name in self.fingerprints):
                    new, old = bits(t), bits(base)
                    if old.device != new.device:
                        old = old.to(new.device)
                    changed = new != old
                    count = int(changed.sum())
                    if count == 0:
                        plan.skipped.append(name)
                        continue
                    numel = t.numel()
                    index_dtype = torch.int32 if numel < 2**31 else torch.int64
                    index_size = 4 if index_dtype == torch.int32 else 8
                    sparse_bytes = _align(count * index_size) + count * t.element_size()
                    if self.sparse and sparse_bytes < t.numel() * t.element_size():
                        index = changed.reshape(-1).nonzero().squeeze(1).to(index_dtype)
                        values = t.detach().reshape(-1)[index]
                        send += [(name + SPARSE_INDEX, index), (name + SPARSE_VALUE, values)]
                        plan.sparse[name] = (index, values)
                        fps[name] = fingerprint(t)
                        continue
                send.append((name, t))
                plan.whole[name] = t
                fps[name] = fingerprint(t)
        plan.spec = DeltaSpec(
            base_version=self.version if use_base else None,
            base_digest=digest(self.fingerprints) if use_base else "",
            sparse=tuple(plan.sparse), fingerprints=fps,
        )
        return plan

    def commit(self, plan: DeltaPlan, *, version: int, partial: bool) -> None:
        """Every engine applied ``plan``: it is the new base (the tensors must not have changed since)."""
        if plan.spec.base_version is None and not partial:
            keep = set(plan.whole)
            for name in [n for n in self.base if n not in keep]:
                del self.base[name]
            self.fingerprints = {}
        elif self.version is None:
            return  # a partial update without a base starts no chain
        with torch.no_grad():
            for name, t in plan.whole.items():
                have = self.base.get(name)
                device = self.device or t.device
                if have is None or have.dtype != t.dtype or have.shape != t.shape or have.device != device:
                    have = self.base[name] = torch.empty(t.shape, dtype=t.dtype, device=device)
                have.copy_(t)
            for name, (index, values) in plan.sparse.items():
                flat = bits(self.base[name]).view(-1)
                flat[index.to(flat.device).long()] = bits(values).to(flat.device)
        self.fingerprints.update(plan.spec.fingerprints)
        self.version = version


# ---- receiver side -----------------------------------------------------------------------------------
@dataclass
class ReceivedBase:
    """What a receiver applied last: the version and every tensor's fingerprint."""

    version: int
    fingerprints: dict[str, int]


def check_base(
    manifest: WeightManifest, base: ReceivedBase | None, current: Callable[[str], torch.Tensor] | None, label: str
) -> None:
    """Raise :class:`DeltaBaseMismatch` unless ``manifest`` (a delta) applies on top of ``base``."""
    spec = manifest.delta
    if spec is None or spec.base_version is None:
        return
    where = f"{label}: delta update v{manifest.version} (on top of v{spec.base_version}) refused"
    if base is None:
        raise DeltaBaseMismatch(f"{where}: this receiver has no recorded base (its last update was not a "
                                "complete push of this weight sync); push a full update")
    if base.version != spec.base_version or digest(base.fingerprints) != spec.base_digest:
        raise DeltaBaseMismatch(f"{where}: the engine is on v{base.version} with other weights than the delta's "
                                "base; push a full update")
    if spec.sparse and current is None:
        err = DeltaBaseMismatch(f"{where}: this engine cannot read its current weights, so it takes no sparse "
                                "deltas; push a full update (the session now sends changed tensors whole)")
        err.sparse_unsupported = True
        raise err
    assert current is not None or not spec.sparse
    for name in spec.sparse:
        assert current is not None
        have = current(name)
        want = base.fingerprints.get(name)
        if want is None or fingerprint(have) != want:
            raise DeltaBaseMismatch(f"{where}: the engine's '{name}' is not the value the base recorded (changed "
                                    "since the last update?); push a full update")


def next_base(manifest: WeightManifest, base: ReceivedBase | None) -> ReceivedBase | None:
    """The receiver's record after ``manifest`` was applied."""
    spec = manifest.delta
    if spec is None:
        return None
    if spec.base_version is None and not manifest.partial:
        return ReceivedBase(manifest.version, dict(spec.fingerprints))
    if base is None:
        return None
    return ReceivedBase(manifest.version, {**base.fingerprints, **spec.fingerprints})


class SparseRebuilder:
    """Turns a delta's received pieces back into whole tensors: each ``name#idx``/``name#val`` pair
    becomes the current value of ``name`` with those elements replaced (a new tensor; the model is
    not touched). Other tensors pass through. Pieces may arrive in different buckets."""

    def __init__(self, manifest: WeightManifest, current: Callable[[str], torch.Tensor] | None) -> None:
        spec = manifest.delta
        self.sparse = set(spec.sparse) if spec is not None else set()
        self.current = current
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def feed(self, views: Iterable[tuple[str, torch.Tensor]], *, owned: bool) -> tuple[Named, Named]:
        """``(passed through, rebuilt)``: the rebuilt tensors are new memory (owned)."""
        plain: Named = []
        rebuilt: Named = []
        for name, t in views:
            base, kind = name[:-4], name[-4:]
            if not self.sparse or kind not in (SPARSE_INDEX, SPARSE_VALUE) or base not in self.sparse:
                plain.append((name, t))
                continue
            got = self._pending.setdefault(base, {})
            got[kind] = t if owned else t.clone()  # the partner may come in a later bucket
            if len(got) == 2:
                del self._pending[base]
                rebuilt.append((base, self._rebuild(base, got[SPARSE_INDEX], got[SPARSE_VALUE])))
        return plain, rebuilt

    def _rebuild(self, name: str, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        assert self.current is not None
        have = self.current(name)
        new = have.detach().clone()
        flat = bits(new).view(-1)
        index = index.to(flat.device).long()
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= flat.numel()):
            raise ManifestMismatch(f"sparse delta of '{name}' indexes outside its {flat.numel()} elements")
        flat[index] = bits(values).to(flat.device)
        return new

    def finish(self) -> None:
        if self._pending:
            raise ManifestMismatch(f"sparse delta pieces without their partner: {sorted(self._pending)[:3]}")


def current_reader(*targets: object) -> Callable[[str], torch.Tensor] | None:
    """The first ``current(name)`` among ``targets`` (a target that reads its model's tensors)."""
    for target in targets:
        reader = getattr(target, "current", None)
        if callable(reader):
            return reader  # type: ignore[no-any-return]
    return None


__all__ = [
    "DeltaBaseMismatch", "DeltaPlan", "DeltaTracker", "ReceivedBase", "SparseRebuilder", "bits", "check_base",
    "current_reader", "digest", "fingerprint", "next_base",
]
