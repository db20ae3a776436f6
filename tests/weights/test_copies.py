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
