"""One kernel that copies (or checksums) many tensors: the work cut into equal chunks, one program each.

``torch._foreach_copy_`` launches a kernel per ~80 MiB of a multi-tensor copy (at most 320
blocks of 64 Ki elements each), and the GPU idles at every launch's tail. This kernel (Triton,
which comes with PyTorch's CUDA builds) gets a table of ``(source address, destination address,
words)`` rows, one per chunk of at most ``CHUNK_BYTES``, and every program copies its chunk in
16-byte words: the whole copy is one launch of thousands of equal programs. On an H200 it copies
320 tensors of 9.6 MiB at 1898-1973 GB/s (one flat copy: 2054; a replayed foreach: 1817), but
bucket by bucket (12 launches of 27 tensors) at only 1705-1791 GB/s, below four parallel foreach
copies (1832), so :class:`~rollout_engines.weights.copies.SteadyCopier` uses it only when
asked (``kernel="chunks"``). The same tables give the ``sum64`` checksum of a zero-copy bucket in one
launch (:func:`checksum`) instead of a reduction per tensor.

It applies only where every address and size is a multiple of 16 bytes (what the caching
allocator and contiguous parameters give); :func:`plan` returns ``None`` otherwise, and the
caller copies another way.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

#: Bytes per program (a multiple of the kernel's block of 16-byte words).
CHUNK_BYTES = 1 << 20
_BLOCK = 2048  # int32 lanes per step: 8 KiB
_WARPS = 8
_ALIGN = 16


@functools.cache
def _kernels() -> tuple[Any, Any] | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_chunks(table, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        row = table + tl.program_id(0).to(tl.int64) * 3
        src = tl.load(row).to(tl.pointer_type(tl.int32))
        dst = tl.load(row + 1).to(tl.pointer_type(tl.int32))
        n = tl.load(row + 2)  # int32 words in this chunk, a multiple of 4
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        n = tl.multiple_of(n, 4)
        offs = tl.arange(0, BLOCK)
        for start in tl.range(0, CHUNK, BLOCK):
            idx = start + offs
            mask = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)

    @triton.jit
    def sum_chunks(table, out, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # The wrapping sum of each chunk's 64-bit words (the ``sum64`` checksum), one per program.
        pid = tl.program_id(0).to(tl.int64)
        row = table + pid * 3
        src = tl.load(row).to(tl.pointer_type(tl.int64))
        n = tl.load(row + 2) // 2  # int64 words, a multiple of 2
        src = tl.multiple_of(src, 16)
        n = tl.multiple_of(n, 2)
        offs = tl.arange(0, BLOCK // 2)
        acc = tl.zeros([BLOCK // 2], dtype=tl.int64)
        for start in tl.range(0, CHUNK // 2, BLOCK // 2):
            idx = start + offs
            acc += tl.load(src + idx, mask=idx < n, other=0)
        tl.store(out + pid, tl.sum(acc, axis=0))

    return copy_chunks, sum_chunks


def available() -> bool:
    return torch.cuda.is_available() and _kernels() is not None


def plan(
    dsts: Sequence[torch.Tensor] | None, srcs: Sequence[torch.Tensor], chunk_bytes: int = CHUNK_BYTES
) -> torch.Tensor | None:
    """The chunk table for ``dst.copy_(src)`` of every pair (``dsts`` None: for :func:`checksum`
    of ``srcs``), on the tensors' device, or ``None`` when a tensor does not qualify (dtype, size,
    contiguity, device or alignment)."""
    rows: list[int] = []
    words_per_chunk = chunk_bytes // 4
    device = srcs[0].device if srcs else None
    for d, s in zip(dsts if dsts is not None else srcs, srcs, strict=True):
        if (d.dtype != s.dtype or d.shape != s.shape or d.device != device or s.device != device
                or not (d.is_contiguous() and s.is_contiguous())):
            return None
        nbytes = d.numel() * d.element_size()
        sp, dp = s.data_ptr(), d.data_ptr()
        if nbytes % _ALIGN or sp % _ALIGN or dp % _ALIGN:
            return None
        words = nbytes // 4
        for start in range(0, words, words_per_chunk):
            rows += (sp + 4 * start, dp + 4 * start, min(words_per_chunk, words - start))
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


def launch(table: torch.Tensor, chunk_bytes: int = CHUNK_BYTES, block: int = _BLOCK, num_warps: int = _WARPS) -> None:
    """Run the copies of a table from :func:`plan` (made with the same ``chunk_bytes``) on the
    current stream."""
    kernels = _kernels()
    assert kernels is not None
    kernels[0][(table.numel() // 3,)](table, CHUNK=chunk_bytes // 4, BLOCK=block, num_warps=num_warps)


def partial_sums(table: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """The wrapping sum of each chunk's 64-bit words, in table order, as an int64 tensor on the
    device (one launch)."""
    kernels = _kernels()
    assert kernels is not None
    partials = torch.empty(table.numel() // 3, dtype=torch.int64, device=table.device)
    kernels[1][(partials.numel(),)](table, partials, CHUNK=chunk_bytes // 4, BLOCK=_BLOCK, num_warps=_WARPS)
    return partials


def checksum(table: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """The ``sum64`` checksum (wrapping sum of 64-bit words) of the sources of a table from
    :func:`plan`, as a 0-dim int64 tensor on the device (one launch, then one reduction)."""
    return partial_sums(table, chunk_bytes).sum()
