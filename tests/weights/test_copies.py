"""SteadyCopier: copies are right whether eager or replayed from a CUDA graph, and a graph never
replays for tensors other than the ones it was captured with."""

from __future__ import annotations

import pytest
import torch
from rollout_engines.weights.copies import SteadyCopier


def _pairs(device: str, n: int = 5) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(n)
    srcs = [torch.randn(3 + i, 7, generator=gen).to(device) for i in range(n)]
    return [torch.zeros_like(s) for s in srcs], srcs


def test_cpu_copies_eagerly_every_time():
    copier = SteadyCopier()
    dsts, srcs = _pairs("cpu")
    for step in range(3):
        for s in srcs:
            s.add_(1.0)
        copier.copy(dsts, srcs)
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True)), step
    assert copier.replays == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_same_tensors_replay_a_graph_and_new_ones_do_not():
    copier = SteadyCopier()
    dsts, srcs = _pairs("cuda")
    for step in range(4):
        if step == 3:
            srcs = [s * 3 for s in srcs]  # new objects: copied eagerly, never by the old graph
        else:
            for s in srcs:
                s.add_(1.0)  # the trainer's in-place update reaches the replayed copies
        copier.copy(dsts, srcs)
        torch.cuda.synchronize()
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True)), step
        assert copier.replays == [0, 1, 2, 2][step], step
    copier.copy(dsts, srcs)  # steady again from step 3: captured, replayed
    assert copier.replays == 3
    dsts[0].data = torch.zeros_like(dsts[0])  # same objects, but a destination lives elsewhere now
    copier.copy(dsts, srcs)
    torch.cuda.synchronize()
    assert torch.equal(dsts[0], srcs[0]) and copier.replays == 3


def _aligned_pairs(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Tensors the chunked kernel takes: 16-byte multiples, one over several 1 MiB chunks, mixed dtypes."""
    gen = torch.Generator().manual_seed(7)
    srcs = [
        torch.randn(3 * 2**18 + 4, generator=gen),  # 3 MiB + 16 bytes: three full chunks and a tail
        torch.randn(64, 8, generator=gen).to(torch.bfloat16),
        torch.randint(0, 100, (16,), generator=gen, dtype=torch.int64),
    ]
    srcs = [s.to(device) for s in srcs]
    return [torch.zeros_like(s) for s in srcs], srcs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["chunks", "streams", "foreach"])
def test_replayed_kernels_copy_every_byte(kernel):
    if kernel == "chunks":
        pytest.importorskip("triton")
    copier = SteadyCopier(kernel=kernel)
    dsts, srcs = _aligned_pairs("cuda")
    for step in range(4):
        for s in srcs:
            s.add_(1)
        copier.copy(dsts, srcs)
        torch.cuda.synchronize()
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True)), step
    assert copier.replays == 3
    assert copier.chunked == (1 if kernel == "chunks" else 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_kernel_declines_what_it_cannot_copy():
    pytest.importorskip("triton")
    from rollout_engines.weights import _chunk_copy

    dsts, srcs = _aligned_pairs("cuda")
    assert _chunk_copy.plan(dsts, srcs) is not None
    odd = torch.zeros(33, device="cuda")[1:]  # 4 bytes past a 16-byte boundary
    assert _chunk_copy.plan([odd], [torch.ones(32, device="cuda")]) is None
    assert _chunk_copy.plan([torch.zeros(8, device="cuda")], [torch.ones(8, device="cuda", dtype=torch.float64)[:8].float()]) is not None
    assert _chunk_copy.plan([torch.zeros(8, device="cuda")], [torch.ones(8, device="cuda", dtype=torch.float64)]) is None
    assert _chunk_copy.plan([torch.zeros(4, 8, device="cuda").t()], [torch.ones(8, 4, device="cuda")]) is None
    # The copier falls back to foreach for such pairs, replayed all the same.
    copier = SteadyCopier(kernel="chunks")
    src = torch.randn(32, device="cuda")
    for _ in range(3):
        src.add_(1)
        copier.copy([odd], [src])
    torch.cuda.synchronize()
    assert torch.equal(odd, src) and copier.replays == 2 and copier.chunked == 0
