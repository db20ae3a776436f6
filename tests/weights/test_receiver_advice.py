"""A receive that fails for a reason the caller can fix says what to do next, and fails only itself."""

from __future__ import annotations

import pytest
import torch
from rollout_engines.errors import WeightSyncError
from rollout_engines.weights.session import connect_weight_sync
from wsync_helpers import bench_receiver

pytestmark = pytest.mark.timeout(120)


class _OutOfMemoryOnce:
    """A fake: a target whose first apply runs out of device memory, as a GPU engine filled up to
    its memory fraction beside the trainer's tensors did (a CPU cannot run out of device memory on
    cue); later applies land."""

    def __init__(self, inner) -> None:
        self.inner, self.failed = inner, False

    def expected_specs(self):
        return self.inner.expected_specs()

    def apply(self, named, *, owned):
        if not self.failed:
            self.failed = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB.")
        self.inner.apply(named, owned=owned)


async def test_a_receive_out_of_device_memory_names_the_memory_fraction_and_the_next_push_lands():
    state = {"a.weight": torch.randn(64, 64), "b.weight": torch.randn(8, 64)}
    engine = bench_receiver(state, _OutOfMemoryOnce)
    sync = await connect_weight_sync([engine], "inproc", timeout_s=30)
    try:
        with pytest.raises(WeightSyncError) as info:
            await sync.push(state, version=1)
        message = str(info.value)
        assert "OutOfMemoryError" in message and "ran out of memory while receiving" in message
        assert "gpu_memory_utilization" in message and "mem_fraction_static" in message
        assert engine.weight_version == 0
        assert await sync.push(state, version=1) == 1
        assert all(torch.equal(engine.target.tensors[k], v) for k, v in state.items())
    finally:
        await sync.close()
        await engine.close()


async def test_other_receive_failures_carry_no_memory_advice():
    class _Broken(_OutOfMemoryOnce):
        def apply(self, named, *, owned):
            raise RuntimeError("a loader bug")

    state = {"a.weight": torch.randn(64, 64)}
    engine = bench_receiver(state, _Broken)
    sync = await connect_weight_sync([engine], "inproc", timeout_s=30)
    try:
        with pytest.raises(WeightSyncError, match="a loader bug") as info:
            await sync.push(state, version=1)
        assert "memory" not in str(info.value)
    finally:
        await sync.close()
        await engine.close()
