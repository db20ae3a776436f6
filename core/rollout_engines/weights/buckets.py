"""Packing tensors into flat bucket buffers and unpacking them as zero-copy views."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from . import _chunk_copy
from .manifest import TensorPlacement, WeightManifest


class BucketHeader(BaseModel):
    """Sent ahead of (or with) every bucket. ``status`` 1 means the sender aborted the update."""

    model_config = ConfigDict(extra="forbid")

    index: int
    nbytes: int
    checksum: int = 0
    status: int = 0
    reason: str = ""

    ABORT: ClassVar[int] = 1


@functools.lru_cache(maxsize=64)
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (``"bfloat16"``); kept once looked up (every view of a push
    asks). An unknown name raises ``ValueError``, every time."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype '{name}'")
    return dtype


#: Words per block of the ``pos64`` checksum (256 bytes: the alignment of tensors in a bucket).
POS_BLOCK_WORDS = 32
_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd: the block-weighted sum cannot cancel the plain one by accident


def checksum(buf: torch.Tensor, algo: str = "pos64") -> int:
    """The integrity checksum of a flat uint8 bucket buffer.

    ``pos64`` (the default): from the 64-bit words' sums per 256-byte block ``b_j``, the wrapping
    ``sum(b_j) + MIX * sum((j + 1) * b_j)``: one pass over the buffer (memory bandwidth on CPU and
    GPU, integer addition is order independent so both ends agree), and it sees truncated, stale,
    mixed and reordered data down to 256 bytes (two swapped tensors of one size, for example).
    ``sum64``: the plain wrapping sum of the words (blind to reordering). ``none``: 0.
    Checksums detect corruption; they authenticate nothing (SECURITY.md).
    """
    if algo == "none":
        return 0
    if buf.storage_offset() % 8:
        buf = buf.clone()  # words need an 8-byte boundary (a slice a few bytes into its storage)
    n = buf.numel() // 8 * 8
    words = buf[:n].view(torch.int64) if n else None
    tail = 0
    for i, b in enumerate(buf[n:].tolist()):
        tail += b << (8 * i)
    if algo == "sum64":
        return (int(words.sum().item()) if words is not None else 0) + tail
    if algo != "pos64":
        raise ValueError(f"unknown checksum '{algo}'; use 'pos64', 'sum64' or 'none'")
    return _pos64(words, tail)


def _pos64(words: torch.Tensor | None, tail: int) -> int:
    blocks = 0
    plain = weighted = 0
    if words is not None and words.numel():
        full = words.numel() // POS_BLOCK_WORDS * POS_BLOCK_WORDS
        parts = []
        if full:
            parts.append(words[:full].view(-1, POS_BLOCK_WORDS).sum(1))
        if full < words.numel():
            parts.append(words[full:].sum().reshape(1))
        sums = torch.cat(parts) if len(parts) > 1 else parts[0]
        blocks = sums.numel()
        index = torch.arange(1, blocks + 1, dtype=torch.int64, device=sums.device)
        both = torch.stack([sums.sum(), (sums * index).sum()]).tolist()
        plain, weighted = both[0], both[1]
    plain += tail
    weighted += tail * (blocks + 1)
    return (plain + _MIX * weighted) & _MASK


def bucket_views(buf: torch.Tensor, placements: Iterable[TensorPlacement]) -> list[tuple[str, torch.Tensor]]:
    """``(name, view)`` for each tensor laid out in ``buf`` (no copies; see :func:`views_at`)."""
    return views_at(buf, ((p.name, torch_dtype(p.dtype), p.shape, p.offset) for p in placements))


def views_at(
    buf: torch.Tensor, rows: Iterable[tuple[str, torch.dtype, tuple[int, ...], int]]
) -> list[tuple[str, torch.Tensor]]:
    """``(name, view)`` of each ``(name, dtype, shape, byte offset)`` row in the flat uint8 ``buf``
    (no copies). One ``as_strided`` per tensor on a view of ``buf`` as its dtype: a slice and two
    views per tensor cost twice as much or more (``benchmarks/bucket_views.py``), milliseconds a
    push for a bucket of hundreds of tensors and tens of milliseconds for a MoE's thousands. A row
    that does not fit ``buf``, or that ``buf`` cannot be viewed at as its dtype (bytes not on a
    multiple of the dtype's size in their storage), goes the plain way, whose errors torch raises
    as it always did."""
    size = buf.numel()
    flats: dict[torch.dtype, tuple[torch.Tensor, int, int] | None] = {}
    out: list[tuple[str, torch.Tensor]] = []
    for name, dtype, shape, offset in rows:
        shape = shape if type(shape) is tuple else tuple(shape)
        flat = flats[dtype] if dtype in flats else flats.setdefault(dtype, _as_dtype(buf, dtype))
        numel, strides = _LAYOUTS.get(shape) or _layout(shape)
        if flat is not None and offset % flat[1] == 0 and offset + numel * flat[1] <= size:
            out.append((name, flat[0].as_strided(shape, strides, flat[2] + offset // flat[1])))
        else:
            out.append((name, buf[offset : offset + numel * dtype.itemsize].view(dtype).view(shape)))
    return out


def _as_dtype(buf: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int, int] | None:
    """``buf`` as ``dtype`` (its whole elements), that dtype's size, and the view's offset in its
    storage; None where ``buf`` is not a flat uint8 run that starts on such an element."""
    isz = dtype.itemsize
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.stride(0) != 1 or buf.storage_offset() % isz:
        return None
    flat = buf[: buf.numel() - buf.numel() % isz].view(dtype)
    return flat, isz, int(flat.storage_offset())


#: Element count and contiguous strides by shape (models repeat a few shapes many times).
_LAYOUTS: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}


def _layout(shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """A shape's element count and a contiguous tensor's strides as torch gives them (a dimension
    of 0 counts as 1), kept for the next time while fewer than 4096 shapes are."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    got = (math.prod(shape), tuple(reversed(strides)))
    if len(_LAYOUTS) < 4096:
        _LAYOUTS[shape] = got
    return got


class BucketViews:
    """Each bucket's tensors as views of a buffer that outlives a push (a transport's slot), built
    once while the layout and the buffer stay the same. A view costs microseconds, so building
    them again every push costs milliseconds for a bucket of hundreds of tensors (tens for a MoE's
    thousands), on both sides of a packed transport.

    Use this only for buffers that stay from push to push: a view keeps a torch allocation alive
    (a fresh buffer each push would be held once more), and :meth:`clear` it when those buffers
    go. Views are reused only while the buffer is at the address they were built at (a view of a
    shared-memory mapping does not keep the mapping: a slot mapped again at the same address is
    the same bytes to them). A layout is the manifest's tensor list, by identity (a steady push
    shares it: :meth:`WeightManifest.model_copy` on the trainer, ``manifest_from_wire`` beyond)."""

    def __init__(self) -> None:
        self._kept: dict[int, _Kept] = {}

    def _entry(self, manifest: WeightManifest, index: int, buf: torch.Tensor) -> _Kept:
        kept = self._kept.get(index)
        ptr = buf.data_ptr()
        if kept is None or kept.tensors is not manifest.tensors or kept.device != buf.device or kept.ptr != ptr:
            kept = self._kept[index] = _Kept(manifest, index, buf)
        return kept

    def get(self, manifest: WeightManifest, index: int, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``(name, view)`` of bucket ``index``'s tensors in ``buf`` (as :func:`bucket_views`)."""
        return self._entry(manifest, index, buf).views

    def clear(self) -> None:
        self._kept.clear()


class _Kept:
    """One bucket's views in one buffer, and what packing into them checks each push."""

    __slots__ = ("tensors", "device", "ptr", "views", "dsts", "expected")

    def __init__(self, manifest: WeightManifest, index: int, buf: torch.Tensor) -> None:
        self.tensors, self.device, self.ptr = manifest.tensors, buf.device, buf.data_ptr()
        self.views = bucket_views(buf, manifest.bucket_tensors(index))
        self.dsts = [v for _, v in self.views]
        self.expected = expected_tensors(manifest, index)


def pack_bucket(
    manifest: WeightManifest, index: int, tensors: Mapping[str, torch.Tensor], out: torch.Tensor,
    views: BucketViews | None = None,
) -> torch.Tensor:
    """Copy the bucket's tensors into ``out`` (a uint8 buffer of at least the bucket's size);
    ``views`` keeps the views of ``out`` for the next push (a buffer that stays, see
    :class:`BucketViews`)."""
    nbytes = manifest.buckets[index].nbytes
    buf = out[:nbytes]
    if views is not None:
        kept = views._entry(manifest, index, out)
        dsts, srcs = kept.dsts, [tensors[name] for name, _, _ in kept.expected]
        check_bucket_tensors(kept.expected, srcs)
    else:
        dsts, srcs = [], []
        for name, view in bucket_views(buf, manifest.bucket_tensors(index)):
            src = tensors[name]
            _check_same(name, src, view.dtype, tuple(view.shape))
            dsts.append(view)
            srcs.append(src)
    # One multi-tensor copy per bucket: per-bucket, not per-tensor, launch cost on a GPU.
    torch._foreach_copy_(dsts, srcs, non_blocking=True)
    return buf


def _check_same(name: str, src: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if src.dtype != dtype or tuple(src.shape) != shape:
        raise ValueError(
            f"tensor '{name}' changed since the manifest was made: "
            f"{src.dtype}{tuple(src.shape)} vs {dtype}{shape}"
        )


def expected_tensors(manifest: WeightManifest, index: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Name, dtype and shape of each tensor of bucket ``index``, as torch objects (a steady push
    checks against these without converting the manifest's strings again)."""
    return [(p.name, torch_dtype(p.dtype), tuple(p.shape)) for p in manifest.bucket_tensors(index)]


def check_bucket_tensors(
    expected: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], tensors: Sequence[torch.Tensor]
) -> None:
    """The bucket's tensors (in manifest order) have the manifest's dtypes and shapes
    (``expected`` from :func:`expected_tensors`)."""
    for (name, dtype, shape), src in zip(expected, tensors, strict=True):
        if src.dtype != dtype or src.shape != shape:
            _check_same(name, src, dtype, shape)


def alloc_bucket(nbytes: int, device: torch.device | str = "cpu", pin: bool = False) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


#: 64-bit words per chunk of a zero-copy bucket's ``pos64`` checksum (the chunked kernel's chunk).
TENSOR_CHUNK_WORDS = _chunk_copy.CHUNK_BYTES // 8


def checksum_tensors(tensors: Sequence[torch.Tensor], algo: str = "pos64") -> int:
    """The checksum of a bucket sent as separate tensors (zero-copy transports), in manifest order.

    ``pos64``: each tensor's words cut into 1 MiB chunks from its start (its last bytes, when not
    a whole word, one more part), every chunk's wrapping sum ``p_c`` in order, then
    ``sum(p_c) + MIX * sum((c + 1) * p_c)``: the tensors' order and the chunks' places count (two
    swapped tensors change it). On a GPU the chunk sums are one kernel launch for the whole bucket.
    ``sum64``: the wrapping sum of every tensor's words, added up."""
    if algo == "none" or not tensors:
        return 0
    if algo not in ("pos64", "sum64"):
        raise ValueError(f"unknown checksum '{algo}'; use 'pos64', 'sum64' or 'none'")
    if tensors[0].is_cuda:
        table = _sum_table(tensors)
        if table is not None:  # one chunked kernel for the whole bucket (rather than sums per tensor)
            partials = _chunk_copy.partial_sums(table)
            if algo == "sum64":
                return int(partials.sum().item())
            return _combine(partials)
    parts: list[torch.Tensor] = []
    tail_total = 0
    for t in tensors:
        raw = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
        if raw.storage_offset() % 8:
            raw = raw.clone()  # a view a few bytes into its storage: words need an 8-byte boundary
        n8 = raw.numel() // 8
        if n8:
            words = raw[: n8 * 8].view(torch.int64)
            full = n8 // TENSOR_CHUNK_WORDS * TENSOR_CHUNK_WORDS if algo == "pos64" else 0
            if full:
                parts.append(words[:full].view(-1, TENSOR_CHUNK_WORDS).sum(1))
            if full < n8:
                parts.append(words[full:].sum().reshape(1))
        if raw.numel() > n8 * 8:
            value = 0
            for i, b in enumerate(raw[n8 * 8 :].tolist()):
                value += b << (8 * i)
            if algo == "sum64":
                tail_total += value
            else:
                parts.append(torch.tensor([value - (1 << 64) if value >= 1 << 63 else value],
                                          dtype=torch.int64, device=raw.device))
    if algo == "sum64":
        return (int(torch.cat(parts).sum().item()) if parts else 0) + tail_total
    return _combine(torch.cat(parts)) if parts else 0


def _combine(partials: torch.Tensor) -> int:
    """``sum(p) + MIX * sum((c + 1) * p)`` of chunk sums, wrapping at 64 bits (one device sync)."""
    index = torch.arange(1, partials.numel() + 1, dtype=torch.int64, device=partials.device)
    plain, weighted = torch.stack([partials.sum(), (partials * index).sum()]).tolist()
    return (plain + _MIX * weighted) & _MASK


#: Chunk tables for checksums on a GPU, by (address, bytes, contiguous) of every tensor: a steady push sums the
#: same memory every time. Bounded; cleared when full.
_SUM_TABLES: dict[tuple[tuple[int, int, bool], ...], torch.Tensor | None] = {}


def _sum_table(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    if not _chunk_copy.available():
        return None
    key = tuple((t.data_ptr(), t.numel() * t.element_size(), t.is_contiguous()) for t in tensors)
    if key in _SUM_TABLES:
        return _SUM_TABLES[key]
    if len(_SUM_TABLES) >= 256:
        _SUM_TABLES.clear()
    table = _SUM_TABLES[key] = _chunk_copy.plan(None, tensors)
    return table
