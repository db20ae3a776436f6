"""The weight-sync manifest: what one update carries, and where each tensor sits in its bucket.

The layout is a pure function of the tensor specs and the bucket size, so the trainer can send the
manifest before it has gathered a single tensor, and every receiver validates the whole update
against its model before it touches a parameter.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import ManifestMismatch

#: Tensors start on this boundary inside a bucket, so a view of any dtype is aligned.
ALIGN = 256
DEFAULT_BUCKET_BYTES = 256 * 2**20

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


class TensorPlacement(TensorSpec):
    bucket: int
    offset: int


class BucketSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int
    nbytes: int = Field(description="Bytes of the flat bucket buffer (tensors at aligned offsets).")
    tensors: tuple[int, ...] = Field(description="Indices into WeightManifest.tensors.")


class WeightManifest(BaseModel):
    """One versioned update: every tensor's name, dtype, shape and place in a bucket."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    version: int
    transport: str = "inproc"
    tensors: list[TensorPlacement]
    buckets: list[BucketSpec]
    total_bytes: int
    checksum: Literal["sum64", "none"] = "sum64"
    timeout_s: float = Field(default=300.0, gt=0)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> WeightManifest:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate tensor names in manifest: {dup[:5]}")
        if sum(t.nbytes for t in self.tensors) != self.total_bytes:
            raise ValueError("total_bytes does not equal the sum of the tensors' sizes")
        for i, b in enumerate(self.buckets):
            if b.index != i:
                raise ValueError("buckets must be numbered 0..n-1 in order")
            for ti in b.tensors:
                t = self.tensors[ti]
                if t.bucket != i or t.offset + t.nbytes > b.nbytes:
                    raise ValueError(f"tensor '{t.name}' does not fit bucket {i} as laid out")
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
    timeout_s: float = Field(default=300.0, gt=0)
    options: dict[str, Any] = Field(default_factory=dict)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_manifest(
    specs: Iterable[TensorSpec],
    *,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport: str = "inproc",
    timeout_s: float = 300.0,
    checksum: Literal["sum64", "none"] = "sum64",
) -> WeightManifest:
    """Lay tensors out into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}")
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
    )


def validate_manifest(manifest: WeightManifest, expected: Mapping[str, TensorSpec], *, partial_ok: bool = True) -> None:
    """Check the whole update against the model before anything is applied.

    Raises :class:`ManifestMismatch` listing every problem (unknown names, wrong shapes, wrong
    dtypes, missing names when ``partial_ok`` is False).
    """
    problems: list[str] = []
    for t in manifest.tensors:
        want = expected.get(t.name)
        if want is None:
            problems.append(f"unknown tensor '{t.name}'")
        elif tuple(want.shape) != tuple(t.shape):
            problems.append(f"'{t.name}': shape {list(t.shape)} != model's {list(want.shape)}")
        elif want.dtype != t.dtype:
            problems.append(f"'{t.name}': dtype {t.dtype} != model's {want.dtype}")
    if not partial_ok:
        missing = sorted(set(expected) - {t.name for t in manifest.tensors})
        if missing:
            problems.append(f"missing {len(missing)} tensors, e.g. {missing[:3]}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ManifestMismatch(
            f"weight update v{manifest.version} rejected before applying anything: {shown}. "
            "Send tensors named, shaped and typed as the engine's model (HF checkpoint names)"
        )


def specs_of(named: Sequence[tuple[str, Any]]) -> list[TensorSpec]:
    """TensorSpecs of ``(name, torch.Tensor)`` pairs (metadata only; no data is touched)."""
    return [TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape)) for n, t in named]


# ---- the manifest across a process hop ------------------------------------------------------------
# A trainer pushes the same layout (names, shapes, buckets) every step; only the version and the
# session token change. Hosts that forward a manifest to another process (ProcessEngine, vLLM's
# collective_rpc) send the layout as one JSON string, and the far side parses and validates a
# layout only when it differs from the last one it saw (a string comparison), so a steady push
# costs neither side the hundreds of pydantic objects of a 300-tensor manifest.
_LAYOUT_FIELDS = {"version", "session_id"}
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
    return {"version": manifest.version, "session_id": manifest.session_id, "layout": layout}


def manifest_from_wire(wire: Mapping[str, Any]) -> WeightManifest:
    """The manifest sent by :func:`manifest_to_wire`; a known layout is reused, not re-parsed (the
    copy shares its tensor and bucket lists, so receivers can cache their checks by identity)."""
    global _received
    received = _received
    update = {"version": int(wire["version"]), "session_id": str(wire["session_id"])}
    if received is not None and received[0] == wire["layout"]:
        return received[1].model_copy(update=update)
    import json

    manifest = WeightManifest.model_validate({**json.loads(wire["layout"]), **update})
    _received = (wire["layout"], manifest)
    return manifest
