"""Core weight buckets as the payloads SGLang's weight-update calls take (pure functions).

Two layouts meet here:

* the core's bucket (:mod:`rollout_engines.weights.buckets`): one uint8 buffer per bucket, every
  tensor at an offset aligned to 256 bytes (padding between tensors);
* SGLang's ``FlattenedTensorBucket``: one uint8 tensor plus, per tensor, ``start_idx`` /
  ``end_idx`` byte offsets. SGLang rebuilds each tensor as
  ``flat[start_idx:end_idx].view(dtype).reshape(shape)``.

Relayed pushes (``update_weights_from_tensor``, see :mod:`.engine`) take one of two forms, both
over CUDA IPC, each a uint8 buffer of aligned tensors (the core's bucket as it is, or the engine's
staging copy of it):

* the plugin's copy-plan loader (``load_format=`` :data:`.loader.LOADER`, engine option
  ``copy_plan``): a one-element named-tensor list, ``[(bucket_name, flat)]``, whose name carries
  the layout (:func:`.loader.bucket_name`); see :func:`loader_payloads`;
* SGLang's own ``load_format="flattened_bucket"``: ``{"flattened_tensor", "metadata"}``, SGLang
  taking the metadata as given, so ``start_idx`` is the tensor's offset in the buffer.

Either way each TP rank gets its own serialized payload (a CUDA IPC handle of the same buffer):
SGLang's producer-side IPC reference counts drop cleanly only when every rank unpickles its own
copy.

``sglang_nccl`` (``update_weights_from_distributed(load_format="flattened_bucket")``): here SGLang
allocates the receive buffer itself, tensors back to back with no padding, and receives it with
one broadcast. The trainer therefore broadcasts the bucket *compacted* to that layout
(:func:`compact_bucket`, a device-to-device copy), in manifest order, split where a tensor would
start misaligned for its dtype (:func:`aligned_chunks`; one call and one broadcast per chunk).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from rollout_engines.weights.buckets import torch_dtype
from rollout_engines.weights.manifest import ALIGN, DTYPE_SIZES, TensorPlacement

from .loader import FORGET, FORGET_ALL, BucketEntry, bucket_name

Serializer = Callable[[Any], bytes]


def tensor_bucket_classes() -> tuple[type, type]:
    """``(FlattenedTensorMetadata, FlattenedTensorBucket)``: SGLang's when importable, else the
    vendored copy (same fields and layout)."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    except ImportError:
        from ._tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    return FlattenedTensorMetadata, FlattenedTensorBucket


def forking_serialize(obj: Any) -> bytes:
    """What SGLang's ``MultiprocessingSerializer.serialize`` does: pickle with torch's reductions
    (tensors travel as shared-memory / CUDA IPC handles, not as data)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def bucket_metadata(placements: Sequence[TensorPlacement], *, base: int = 0) -> list[Any]:
    """SGLang metadata for tensors laid out as in the core bucket (``base``: offset of the bucket
    in the buffer handed over)."""
    meta_cls, _ = tensor_bucket_classes()
    out = []
    for p in placements:
        start = base + p.offset
        out.append(
            meta_cls(
                name=p.name,
                shape=torch.Size(p.shape),
                dtype=torch_dtype(p.dtype),
                start_idx=start,
                end_idx=start + p.nbytes,
                numel=p.nbytes,
            )
        )
    return out


def serialize_per_rank(
    flat: torch.Tensor, metadata: Sequence[Any], tp_size: int, serialize: Serializer | None = None
) -> list[bytes]:
    """One serialized ``{"flattened_tensor", "metadata"}`` payload per TP rank, the form
    ``update_weights_from_tensor(named_tensors=..., load_format="flattened_bucket")`` takes.

    Serialized once per rank on purpose (see the module docstring): do not share one blob. The
    payloads reference ``flat`` (CUDA IPC handles), so it must stay alive until SGLang's call
    returns.
    """
    return _per_rank({"flattened_tensor": flat, "metadata": list(metadata)}, tp_size, serialize)


def loader_payloads(
    flat: torch.Tensor, metadata: Sequence[Any], tp_size: int, serialize: Serializer | None = None,
    *, forget_first: bool = False, name: str | None = None,
) -> list[bytes]:
    """One serialized ``[(bucket_name, flat)]`` per TP rank, the form
    ``update_weights_from_tensor(load_format=LOADER)`` hands to :func:`.loader.load_bucket`
    (``metadata``: SGLang's flattened-bucket metadata of ``flat``, as :func:`stage_views` returns
    it; ``name``: its bucket name where known, as :class:`Stager` keeps it per layout). Like
    :func:`serialize_per_rank`, the payloads reference ``flat``. ``forget_first``: the loader first
    drops the buffers it kept from earlier pushes (``flat`` is in a new one)."""
    name = name or metadata_name(metadata)
    return _per_rank([(FORGET, flat[:1])] * forget_first + [(name, flat)], tp_size, serialize)


def metadata_name(metadata: Sequence[Any]) -> str:
    """The loader's bucket name (:func:`.loader.bucket_name`) of SGLang's flattened-bucket metadata."""
    return bucket_name(BucketEntry(m.name, m.dtype, tuple(m.shape), m.start_idx, m.end_idx) for m in metadata)


def forget_payloads(
    buffer: torch.Tensor, tp_size: int, serialize: Serializer | None = None, *, shared: bool = False
) -> list[bytes]:
    """Per-rank payloads that only make the loader let go of what it kept (``buffer``: any tensor
    on the engine's device, e.g. the staging buffer about to be freed; it is not read).
    ``shared``: also unmap the trainer's memory it opened for forwarded buckets."""
    return _per_rank([(FORGET_ALL if shared else FORGET, buffer[:1])], tp_size, serialize)


def _per_rank(payload: Any, tp_size: int, serialize: Serializer | None) -> list[bytes]:
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    serialize = serialize or forking_serialize
    return [serialize(payload) for _ in range(tp_size)]


def flattened_bucket_payloads(
    buf: torch.Tensor,
    placements: Sequence[TensorPlacement],
    tp_size: int,
    serialize: Serializer | None = None,
) -> list[bytes]:
    """Per-rank payloads of a core bucket buffer (uint8, tensors at their manifest offsets), handed
    over without a copy."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"a bucket buffer is a 1-D uint8 tensor, got {buf.dtype} with shape {tuple(buf.shape)}")
    end = max((p.offset + p.nbytes for p in placements), default=0)
    if buf.numel() < end:
        raise ValueError(f"bucket buffer holds {buf.numel()} bytes, the layout needs {end}")
    return serialize_per_rank(buf[:end], bucket_metadata(placements), tp_size, serialize)


def stage_views(
    named: Sequence[tuple[str, torch.Tensor]], staging: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Copy ``named`` tensors into one uint8 buffer on ``device`` at aligned offsets.

    Used where the bucket cannot be handed over as it is (it lives on the CPU, or it is itself a
    CUDA IPC import, which torch refuses to share again). Returns ``(staging, flat, metadata)``:
    ``staging`` is the (possibly grown) buffer to reuse for the next bucket, ``flat`` the part
    used. :class:`Stager` does the same and keeps the views for the next bucket of that layout.
    """
    staging, flat, dsts, metadata = _layout(named, staging, device)
    _copy_in(dsts, named, device)
    return staging, flat, metadata


class Staged(NamedTuple):
    """A bucket in the staging buffer: the part used, SGLang's metadata of it, and its bucket name
    for the plugin's loader (:func:`metadata_name`)."""

    flat: torch.Tensor
    metadata: list[Any]
    name: str


class Stager:
    """:func:`stage_views` for a stream of buckets: one staging buffer on ``device``, kept across
    buckets and pushes, and per bucket layout (names, dtypes, shapes) the views, SGLang metadata
    and bucket name built for it, so a push of the same layout (every step of an RL loop) only copies:
    one multi-tensor copy per bucket instead of a copy, two views and a metadata object per
    tensor (on an H200, ~1B model, 195 tensors: 3.5-5.4 ms per push staged one by one)."""

    #: Layouts remembered at most (partial and delta pushes bring a new one each step).
    MAX_LAYOUTS = 32

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: torch.Tensor | None = None
        self._layouts: dict[tuple[Any, ...], tuple[Staged, list[torch.Tensor]]] = {}

    @property
    def buffer(self) -> torch.Tensor | None:
        """The staging buffer (None before the first bucket); a new one when a bucket outgrew it."""
        return self._buffer

    def stage(self, named: Sequence[tuple[str, torch.Tensor]]) -> Staged:
        """``named`` copied into the staging buffer (valid until the next call)."""
        key = tuple((n, t.dtype, t.shape) for n, t in named)
        known = self._layouts.get(key)
        if known is None:
            buffer, flat, dsts, metadata = _layout(named, self._buffer, self.device)
            if buffer is not self._buffer or len(self._layouts) >= self.MAX_LAYOUTS:
                # Grown (the views of other layouts point at the old buffer), or too many to keep.
                self._buffer, self._layouts = buffer, {}
            known = self._layouts[key] = (Staged(flat, metadata, metadata_name(metadata)), dsts)
        staged, dsts = known
        _copy_in(dsts, named, self.device)
        return staged


def _layout(
    named: Sequence[tuple[str, torch.Tensor]], staging: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[Any]]:
    """``(staging, flat, views, metadata)``: ``named`` laid out at aligned offsets in ``staging``
    (allocated or grown as needed), one view per tensor and SGLang's metadata of the layout."""
    meta_cls, _ = tensor_bucket_classes()
    offsets, end = [], 0
    for _, t in named:
        offsets.append(end)
        end = _align(end + t.numel() * t.element_size())
    if staging is None or staging.numel() < end or staging.device != device:
        staging = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
    dsts, metadata = [], []
    for (name, t), off in zip(named, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        dsts.append(staging[off : off + nbytes].view(t.dtype).view(t.shape))
        metadata.append(meta_cls(name=name, shape=t.shape, dtype=t.dtype, start_idx=off, end_idx=off + nbytes, numel=nbytes))
    return staging, staging[:end], dsts, metadata


def _copy_in(dsts: list[torch.Tensor], named: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> None:
    """One multi-tensor copy into the staging views, finished before SGLang's processes read them."""
    if dsts:
        torch._foreach_copy_(dsts, [t for _, t in named], non_blocking=True)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def packed_nbytes(placements: Sequence[TensorPlacement]) -> int:
    return sum(p.nbytes for p in placements)


def aligned_chunks(placements: Sequence[TensorPlacement]) -> list[list[TensorPlacement]]:
    """Split a bucket's tensors (in manifest order) into runs SGLang can receive in one flat buffer.

    SGLang rebuilds each tensor as a view of its packed receive buffer, and a view of dtype D must
    start at a multiple of D's size: after a bfloat16 tensor of odd length an int64 or float32
    tensor cannot follow in the same buffer (torch refuses the view). A new run starts wherever
    the next tensor would be misaligned. Sender and engine both call this, so they agree on the
    number of broadcasts.
    """
    chunks: list[list[TensorPlacement]] = []
    current: list[TensorPlacement] = []
    offset = 0
    for p in placements:
        if current and offset % DTYPE_SIZES[p.dtype]:
            chunks.append(current)
            current, offset = [], 0
        current.append(p)
        offset += p.nbytes
    if current:
        chunks.append(current)
    return chunks


def distributed_args(placements: Sequence[TensorPlacement]) -> dict[str, list[Any]]:
    """``names``, ``dtypes``, ``shapes`` of ``update_weights_from_distributed`` for one bucket, in
    manifest order (the order SGLang lays the tensors out in its receive buffer)."""
    return {
        "names": [p.name for p in placements],
        "dtypes": [p.dtype for p in placements],
        "shapes": [list(p.shape) for p in placements],
    }


def compact_bucket(
    buf: torch.Tensor, placements: Sequence[TensorPlacement], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The core bucket ``buf`` rewritten in SGLang's packed layout (tensors back to back, manifest
    order): what SGLang's ``_update_bucketed_weights_from_distributed`` expects to receive."""
    total = packed_nbytes(placements)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=buf.device)
    elif out.numel() < total:
        raise ValueError(f"output buffer holds {out.numel()} bytes, need {total}")
    dst = 0
    # Merge runs of tensors that are already contiguous in the source into one copy each.
    run_src = run_dst = run_len = 0
    for p in placements:
        if run_len and run_src + run_len == p.offset:
            run_len += p.nbytes
        else:
            if run_len:
                out[run_dst : run_dst + run_len].copy_(buf[run_src : run_src + run_len], non_blocking=True)
            run_src, run_dst, run_len = p.offset, dst, p.nbytes
        dst += p.nbytes
    if run_len:
        out[run_dst : run_dst + run_len].copy_(buf[run_src : run_src + run_len], non_blocking=True)
    return out[:total]
