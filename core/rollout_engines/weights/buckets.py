"""Packing tensors into flat bucket buffers and unpacking them as zero-copy views."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
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


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype '{name}'")
    return dtype


def checksum(buf: torch.Tensor, algo: str = "sum64") -> int:
    """Wrapping sum of the buffer as 64-bit words: catches truncated, stale or mixed buckets.

    It runs at memory bandwidth on CPU and GPU alike (integer addition is order independent, so
    both ends agree). It is an integrity check, not a cryptographic hash.
    """
    if algo == "none":
        return 0
    n = buf.numel() // 8 * 8
    total = int(buf[:n].view(torch.int64).sum().item()) if n else 0
    for i, b in enumerate(buf[n:].tolist()):
        total += b << (8 * i)
    return total


def bucket_views(
    buf: torch.Tensor, placements: Iterable[TensorPlacement]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, view)`` for each tensor laid out in ``buf`` (no copies)."""
    for p in placements:
        flat = buf[p.offset : p.offset + p.nbytes]
        yield p.name, flat.view(torch_dtype(p.dtype)).view(p.shape)


def pack_bucket(
    manifest: WeightManifest, index: int, tensors: Mapping[str, torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Copy the bucket's tensors into ``out`` (a uint8 buffer of at least the bucket's size)."""
    nbytes = manifest.buckets[index].nbytes
    buf = out[:nbytes]
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


def checksum_tensors(tensors: Sequence[torch.Tensor], algo: str = "sum64") -> int:
    """The checksum of a bucket sent as separate tensors (zero-copy transports): the wrapping sum
    of each tensor's bytes as 64-bit words, added up. Computed on the device with one sync."""
    if algo == "none" or not tensors:
        return 0
    if tensors[0].is_cuda:
        table = _sum_table(tensors)
        if table is not None:  # one chunked kernel for the whole bucket (rather than a sum per tensor)
            return int(_chunk_copy.checksum(table).item())
    parts: list[torch.Tensor] = []
    total = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes % 8 == 0 and t.is_contiguous():  # the common case: no slicing, no sync
            parts.append(t.view(-1).view(torch.int64).sum())
            continue
        raw = t.reshape(-1).view(torch.uint8)
        n = nbytes // 8 * 8
        if n:
            parts.append(raw[:n].view(torch.int64).sum())
        for i, b in enumerate(raw[n:].tolist()):
            total += b << (8 * i)
    if parts:
        total += int(torch.stack(parts).sum().item())
    return total


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
