"""The weight-sync manifest: what one update carries, and where each tensor sits in its bucket.

The layout is a pure function of the tensor specs and the bucket size, so the trainer can send the
manifest before it has gathered a single tensor, and every receiver validates the whole update
against its model before it touches a parameter.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import ManifestMismatch
from ..types import LoraSpec

#: Tensors start on this boundary inside a bucket, so a view of any dtype is aligned.
ALIGN = 256
DEFAULT_BUCKET_BYTES = 256 * 2**20
#: Integrity checksum of each bucket (see :func:`.buckets.checksum`).
ChecksumKind = Literal["pos64", "sum64", "none"]
DEFAULT_TIMEOUT_S = 300.0
#: The longest any weight-sync wait may be (seconds); ``ROLLOUT_ENGINES_MAX_TIMEOUT_S`` changes it.
MAX_TIMEOUT_S = float(os.environ.get("ROLLOUT_ENGINES_MAX_TIMEOUT_S", "3600"))


def check_timeout(value: float) -> float:
    """A weight-sync timeout: positive and at most :data:`MAX_TIMEOUT_S`."""
    if not value > 0:
        raise ValueError(f"timeout_s must be > 0, got {value}")
    if value > MAX_TIMEOUT_S:
        raise ValueError(
            f"timeout_s={value:g} is above the ceiling of {MAX_TIMEOUT_S:g} s; every wait is bounded. "
            "Use a smaller timeout or raise ROLLOUT_ENGINES_MAX_TIMEOUT_S in every process"
        )
    return value

DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    @model_validator(mode="after")
    def _known_dtype(self) -> TensorSpec:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported dtype '{self.dtype}' for '{self.name}'")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape of '{self.name}'")
        return self


class ExpectedSpec(TensorSpec):
    """What a model expects under one name; ``tied_to``: other names of the same parameter (a push
    that carries any of them covers this one)."""

    tied_to: tuple[str, ...] = ()


class TensorPlacement(TensorSpec):
    bucket: int = Field(ge=0)
    offset: int = Field(ge=0)


class BucketSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    nbytes: int = Field(ge=0, description="Bytes of the flat bucket buffer (tensors at aligned offsets).")
    tensors: tuple[int, ...] = Field(description="Indices into WeightManifest.tensors.")


#: Names of the two placements that carry a sparse delta of tensor ``name``: ``name + SPARSE_INDEX``
#: (flat element indices, int32 or int64) and ``name + SPARSE_VALUE`` (the new values, the tensor's dtype).
SPARSE_INDEX = "#idx"
SPARSE_VALUE = "#val"


class DeltaSpec(BaseModel):
    """How an update relates to the session's last complete one (delta pushes, :mod:`.delta`).

    ``base_version`` ``None``: the update is not a delta (a full push of a session that tracks its
    pushes); otherwise it is applied on top of exactly that version, whose per-tensor fingerprints
    digest to ``base_digest``: tensors it does not carry are unchanged since then, and each name in
    ``sparse`` travels as two placements (``name#idx``, ``name#val``: flat indices and new values).
    ``fingerprints``: the ``pos64`` checksum of the new value of every tensor the update changes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_version: int | None = None
    base_digest: str = ""
    sparse: tuple[str, ...] = ()
    fingerprints: dict[str, int] = Field(default_factory=dict)


class WeightManifest(BaseModel):
    """One versioned update: every tensor's name, dtype, shape and place in a bucket.

    ``partial``: the update carries only some of the model's tensors (refused otherwise: a push is
    complete by default). ``allow_rollback``: the version may be lower than or equal to the engine's.
    ``delta``: set by sessions that track their pushes (``delta=True``); a manifest whose
    ``delta.base_version`` is set carries only what changed since that version and is complete
    once applied on top of it (receivers refuse it on any other base).
    """

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    version: int
    transport: str = "inproc"
    tensors: list[TensorPlacement]
    buckets: list[BucketSpec]
    total_bytes: int
    checksum: ChecksumKind = "pos64"
    timeout_s: float = DEFAULT_TIMEOUT_S
    partial: bool = False
    allow_rollback: bool = False
    options: dict[str, Any] = Field(default_factory=dict)
    delta: DeltaSpec | None = None
    #: Set for a LoRA push (:meth:`WeightSync.push_lora`): the tensors are that adapter's, named as
    #: PEFT names them; ``version`` is the adapter's version, not the base weights'.
    lora: LoraSpec | None = None

    _timeout = field_validator("timeout_s")(classmethod(lambda cls, v: check_timeout(v)))

    @model_validator(mode="after")
    def _consistent(self) -> WeightManifest:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate tensor names in manifest: {dup[:5]}")
        if sum(t.nbytes for t in self.tensors) != self.total_bytes:
            raise ValueError("total_bytes does not equal the sum of the tensors' sizes")
        placed = [0] * len(self.tensors)
        for i, b in enumerate(self.buckets):
            if b.index != i:
                raise ValueError("buckets must be numbered 0..n-1 in order")
            spans = []
            for ti in b.tensors:
                if not 0 <= ti < len(self.tensors):
                    raise ValueError(f"bucket {i} names tensor index {ti}; the manifest has {len(self.tensors)}")
                placed[ti] += 1
                t = self.tensors[ti]
                if t.bucket != i or t.offset + t.nbytes > b.nbytes:
                    raise ValueError(f"tensor '{t.name}' does not fit bucket {i} as laid out")
                spans.append((t.offset, t.offset + t.nbytes, t.name))
            spans.sort()
            for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
                if start < end:
                    raise ValueError(f"tensors '{first}' and '{second}' overlap in bucket {i}")
        lost = [self.tensors[k].name for k, count in enumerate(placed) if count != 1]
        if lost:
            raise ValueError(f"every tensor must be in exactly one bucket; not so for {lost[:5]}")
        return self

    def bucket_tensors(self, index: int) -> list[TensorPlacement]:
        return [self.tensors[i] for i in self.buckets[index].tensors]


class TransportSpec(BaseModel):
    """How one engine joins a trainer's weight-sync session (sent once, at connect time)."""

    model_config = ConfigDict(extra="forbid")

    transport: str
    session_id: str
    rank_offset: int = Field(default=1, ge=0, description="Rank of this engine's first worker.")
    world_size: int = Field(default=2, ge=1)
    timeout_s: float = DEFAULT_TIMEOUT_S
    options: dict[str, Any] = Field(default_factory=dict, repr=False)  # holds the session's secret

    _timeout = field_validator("timeout_s")(classmethod(lambda cls, v: check_timeout(v)))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_manifest(
    specs: Iterable[TensorSpec],
    *,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport: str = "inproc",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    checksum: ChecksumKind = "pos64",
    partial: bool = False,
    allow_rollback: bool = False,
    delta: DeltaSpec | None = None,
    lora: LoraSpec | None = None,
) -> WeightManifest:
    """Lay tensors out into buckets of at most ``bucket_bytes`` (a larger tensor gets its own).
    Raises :class:`ManifestMismatch` for duplicate names."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}")
    specs = list(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        dup = sorted({n for n in names if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
        raise ManifestMismatch(
            f"weight update v{version} names {len(dup)} tensor(s) more than once, e.g. {dup[:3]}; "
            "send each tensor once"
        )
    placed: list[TensorPlacement] = []
    buckets: list[BucketSpec] = []
    current: list[int] = []
    offset = 0

    def close_bucket() -> None:
        nonlocal current, offset
        if current:
            buckets.append(BucketSpec(index=len(buckets), nbytes=offset, tensors=tuple(current)))
        current, offset = [], 0

    for spec in specs:
        size = spec.nbytes
        if current and offset + size > bucket_bytes:
            close_bucket()
        placed.append(TensorPlacement(**spec.model_dump(), bucket=len(buckets), offset=offset))
        current.append(len(placed) - 1)
        offset = _align(offset + size)
    close_bucket()
    return WeightManifest(
        version=version,
        transport=transport,
        tensors=placed,
        buckets=buckets,
        total_bytes=sum(t.nbytes for t in placed),
        timeout_s=timeout_s,
        checksum=checksum,
        partial=partial,
        allow_rollback=allow_rollback,
        delta=delta,
        lora=lora,
    )


def validate_manifest(
    manifest: WeightManifest, expected: Mapping[str, TensorSpec], *, partial_ok: bool | None = None
) -> None:
    """Check the whole update against the model before anything is applied.

    Raises :class:`ManifestMismatch` listing every problem (unknown names, wrong shapes, wrong
    dtypes, and, unless the update is partial (``partial_ok``, by default ``manifest.partial``),
    tensors of the model it does not carry; a tied parameter is covered by any of its names). A delta
    (``manifest.delta.base_version`` set) is complete on top of its base, and its sparse pieces are
    checked against the tensor they change.
    """
    delta = manifest.delta
    if partial_ok is None:
        partial_ok = manifest.partial or (delta is not None and delta.base_version is not None)
    problems: list[str] = []
    sparse = set(delta.sparse) if delta is not None else set()
    if sparse:
        problems += _sparse_problems(manifest, expected, sparse)
    for t in manifest.tensors:
        if sparse and t.name[-4:] in (SPARSE_INDEX, SPARSE_VALUE) and t.name[:-4] in sparse:
            continue  # checked above
        if t.name in sparse:
            problems.append(f"'{t.name}' is both sent whole and as a sparse delta")
            continue
        want = expected.get(t.name)
        if want is None:
            problems.append(f"unknown tensor '{t.name}'")
        elif tuple(want.shape) != tuple(t.shape):
            problems.append(f"'{t.name}': shape {list(t.shape)} != model's {list(want.shape)}")
        elif want.dtype != t.dtype:
            problems.append(f"'{t.name}': dtype {t.dtype} != model's {want.dtype}")
    if not partial_ok:
        missing = missing_names(manifest, expected)
        if missing:
            problems.append(
                f"missing {len(missing)} of the model's tensors, e.g. {missing[:3]} (a push must be complete; "
                "pass partial=True to send only some tensors)"
            )
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        fused = any(t.name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and t.name not in expected
                    for t in manifest.tensors)
        raise ManifestMismatch(
            f"weight update v{manifest.version} rejected before applying anything: {shown}. "
            "Send tensors named, shaped and typed as the engine's model (HF checkpoint names)"
            + (". Experts fused by transformers 5 go under their checkpoint names, one per expert: "
               "push rollout_engines.weights.experts.checkpoint_named(model)" if fused else "")
        )


def _sparse_problems(manifest: WeightManifest, expected: Mapping[str, TensorSpec], sparse: set[str]) -> list[str]:
    """What is wrong with the sparse pieces of a delta (pairs of 1-D index and value placements)."""
    problems: list[str] = []
    pieces = {t.name: t for t in manifest.tensors}
    for name in sorted(sparse):
        want = expected.get(name)
        index, value = pieces.get(name + SPARSE_INDEX), pieces.get(name + SPARSE_VALUE)
        if want is None:
            problems.append(f"unknown tensor '{name}' (sparse delta)")
        elif index is None or value is None:
            problems.append(f"'{name}': a sparse delta needs both '{name}{SPARSE_INDEX}' and '{name}{SPARSE_VALUE}'")
        elif index.dtype not in ("int32", "int64") or len(index.shape) != 1:
            problems.append(f"'{name}{SPARSE_INDEX}': indices must be 1-D int32 or int64")
        elif value.dtype != want.dtype or tuple(value.shape) != tuple(index.shape):
            problems.append(f"'{name}{SPARSE_VALUE}': {value.dtype}{list(value.shape)}, expected "
                            f"{want.dtype}{list(index.shape)} (one value of the model's dtype per index)")
        else:
            numel = 1
            for d in want.shape:
                numel *= d
            if index.shape[0] > numel:
                problems.append(f"'{name}': {index.shape[0]} changed elements of {numel}")
    return problems


def missing_names(manifest: WeightManifest, expected: Mapping[str, TensorSpec]) -> list[str]:
    """Names the model expects that ``manifest`` does not cover (tied names count as covered)."""
    carried = {t.name for t in manifest.tensors}
    return sorted(
        n for n, spec in expected.items()
        if n not in carried
        and not (isinstance(spec, ExpectedSpec) and any(alias in carried for alias in spec.tied_to))
    )


def specs_of(named: Iterable[tuple[str, Any]]) -> list[TensorSpec]:
    """TensorSpecs of ``(name, torch.Tensor)`` pairs (metadata only; no data is touched)."""
    return [TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape)) for n, t in named]


# ---- the manifest across a process hop ------------------------------------------------------------
# A trainer pushes the same layout (names, shapes, buckets) every step; only the version and the
# session token change. Hosts that forward a manifest to another process (ProcessEngine, vLLM's
# collective_rpc) send the layout as one JSON string, and the far side parses and validates a
# layout only when it differs from the last one it saw (a string comparison), so a steady push
# costs neither side the hundreds of pydantic objects of a 300-tensor manifest.
_LAYOUT_FIELDS = {"version", "session_id", "partial", "allow_rollback", "delta", "lora"}
_sent: tuple[list[TensorPlacement], str] | None = None
_received: tuple[str, WeightManifest] | None = None


def manifest_to_wire(manifest: WeightManifest) -> dict[str, Any]:
    """A JSON-serialisable form of ``manifest`` for another process (see :func:`manifest_from_wire`)."""
    global _sent
    sent = _sent
    if sent is not None and sent[0] is manifest.tensors:
        layout = sent[1]
    else:
        layout = manifest.model_dump_json(exclude=_LAYOUT_FIELDS)
        _sent = (manifest.tensors, layout)
    wire = {"version": manifest.version, "session_id": manifest.session_id, "partial": manifest.partial,
            "allow_rollback": manifest.allow_rollback, "layout": layout}
    if manifest.delta is not None:  # changes every push: not part of the cached layout
        wire["delta"] = manifest.delta.model_dump(mode="json")
    if manifest.lora is not None:
        wire["lora"] = manifest.lora.model_dump(mode="json")
    return wire


def manifest_from_wire(wire: Mapping[str, Any]) -> WeightManifest:
    """The manifest sent by :func:`manifest_to_wire`; a known layout is reused, not re-parsed (the
    copy shares its tensor and bucket lists, so receivers can cache their checks by identity)."""
    global _received
    received = _received
    update = {"version": int(wire["version"]), "session_id": str(wire["session_id"]),
              "partial": bool(wire.get("partial", False)), "allow_rollback": bool(wire.get("allow_rollback", False)),
              "delta": DeltaSpec.model_validate(wire["delta"]) if wire.get("delta") is not None else None,
              "lora": LoraSpec.model_validate(wire["lora"]) if wire.get("lora") is not None else None}
    if received is not None and received[0] == wire["layout"]:
        return received[1].model_copy(update=update)
    import json

    manifest = WeightManifest.model_validate({**json.loads(wire["layout"]), **update})
    _received = (wire["layout"], manifest)
    return manifest
