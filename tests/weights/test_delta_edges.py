"""Delta pushes at their edges: tensor fingerprints and delta plans must take any tensor a trainer
holds (views at any byte offset, e.g. parameters kept in one flat buffer).

Real receiving engines (the benchmark's receiver over a state dict) in this process (``inproc``)."""

from __future__ import annotations

import pytest
import torch
from rollout_engines.weights.delta import DeltaTracker, fingerprint
from rollout_engines.weights.session import connect_weight_sync
from wsync_helpers import bench_receiver

pytestmark = [pytest.mark.timeout(120)]


def _state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 64, generator=gen).to(dtype), "a.bias": torch.randn(64, generator=gen).to(dtype),
            "b.weight": torch.randn(8, 64, generator=gen).to(dtype)}


def test_fingerprint_of_a_view_at_any_byte_offset_is_that_of_its_values():
    flat = torch.arange(1, 4098, dtype=torch.float32).bfloat16()
    for start in range(0, 9):
        view = flat[start : start + 4000].view(40, 100)  # storage offset 2 * start bytes
        assert fingerprint(view) == fingerprint(view.clone())
    odd = torch.arange(27, dtype=torch.uint8)[3:]
    assert fingerprint(odd) == fingerprint(odd.clone())
    assert fingerprint(flat[3:].view(-1)[::2]) == fingerprint(flat[3:].view(-1)[::2].contiguous())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
async def test_delta_push_of_views_at_unaligned_offsets(dtype):
    """A trainer that keeps its parameters in one flat buffer hands over views at any offset
    (here 2 or 4 bytes past a word): a delta push takes them as any other tensor."""
    state = _state(0, dtype)
    flat = torch.cat([t.reshape(-1) for t in state.values()] + [torch.zeros(1, dtype=dtype)])
    flat = torch.cat([torch.zeros(1, dtype=dtype), flat])  # every view starts one element in

    def views() -> dict[str, torch.Tensor]:
        out, off = {}, 1
        for name, t in state.items():
            out[name] = flat[off : off + t.numel()].view(t.shape)
            off += t.numel()
        return out

    engine = bench_receiver(state)
    sync = await connect_weight_sync([engine], "inproc", timeout_s=30, delta=True)
    try:
        await sync.push(views(), version=1)
        flat[1 + 5 : 1 + 15] += 1  # a few elements of a.weight
        await sync.push(views(), version=2)
        assert 0 < sync.last_push_bytes < 64 * 64 * flat.element_size()
        for name, want in views().items():
            assert torch.equal(engine.target.tensors[name], want), name
    finally:
        await sync.close()
        await engine.close()


def test_tracker_plans_views_at_unaligned_offsets():
    flat = torch.randn(1001)
    items = [("x", flat[1:1001].view(10, 100))]
    tracker = DeltaTracker()
    first = tracker.plan(items, delta=True, partial=False)
    tracker.commit(first, version=1, partial=False)
    flat[-1] += 1.0  # only the last element
    plan = tracker.plan(items, delta=True, partial=False)
    assert list(plan.sparse) == ["x"]
    index, values = plan.sparse["x"]
    assert index.tolist() == [999] and values.tolist() == [float(flat[-1])]
