"""``push(wake=True)``'s worker side (:mod:`rollout_engines_vllm.wake`) against vLLM's own
``CuMemAllocator`` bookkeeping.

The allocator's driver calls (``create_and_map`` / ``unmap_and_release``) need a GPU; here they are
replaced by recorders (named fakes), and the allocations are ranges of host memory under real
tensors, so which range each bucket maps, and what vLLM's own ``wake_up`` does after the hand-over,
run as on a GPU. The GPU test (test_gpu_vllm.py) runs the whole path with real mappings.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class Recorder:
    """Fake driver calls: the start pointers of the handles mapped and released, in order."""

    def __init__(self) -> None:
        self.mapped: list[int] = []
        self.released: list[int] = []

    def create_and_map(self, handle: Any) -> None:
        self.mapped.append(int(handle[2]))

    def unmap_and_release(self, handle: Any) -> None:
        self.released.append(int(handle[2]))


@pytest.fixture
def layout(monkeypatch):
    """vLLM's allocator holding four released ranges (three of weights, one of KV cache) under a
    two-layer model's parameters, with the driver calls recorded."""
    from vllm.device_allocator import cumem

    recorder = Recorder()
    monkeypatch.setattr(cumem, "create_and_map", recorder.create_and_map)
    monkeypatch.setattr(cumem, "unmap_and_release", recorder.unmap_and_release)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None, raising=False)
    ranges = [torch.empty(4096, dtype=torch.uint8) for _ in range(4)]
    allocator = cumem.CuMemAllocator()
    for r, tag in zip(ranges, ("weights", "weights", "weights", "kv_cache"), strict=True):
        ptr = r.data_ptr()
        allocator.pointer_to_data[ptr] = cumem.AllocationData(handle=(0, r.numel(), ptr, 0), tag=tag, is_asleep=True)

    def view(r: torch.Tensor, offset: int, n: int) -> torch.Tensor:
        return r[offset:offset + n * 2].view(torch.bfloat16)

    params = {
        "model.embed_tokens.weight": view(ranges[0], 0, 512),
        "model.layers.0.self_attn.qkv_proj.weight": view(ranges[0], 1024, 1024),
        "model.layers.0.mlp.gate_up_proj.weight": view(ranges[1], 0, 1024),
        "model.layers.1.self_attn.qkv_proj.weight": view(ranges[1], 2048, 512),
        "model.layers.1.mlp.gate_up_proj.weight": view(ranges[2], 0, 1024),
        "model.norm.weight": view(ranges[2], 3072, 16),
    }
    starts = [r.data_ptr() for r in ranges]
    return allocator, params, recorder, starts, cumem


def waker_of(allocator, params, cumem):
    from rollout_engines_vllm.wake import LazyWeightsWake

    return LazyWeightsWake(allocator, params, PACKED, create_and_map=cumem.create_and_map,
                           unmap_and_release=cumem.unmap_and_release)


def test_each_bucket_maps_the_ranges_under_its_parameters_once(layout):
    allocator, params, recorder, starts, cumem = layout
    waker = waker_of(allocator, params, cumem)
    assert waker.left == 3  # the KV cache's range is not the weights'
    waker.before(["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                  "model.layers.0.self_attn.k_proj.weight"])  # checkpoint names: into qkv_proj
    assert recorder.mapped == [starts[0]]
    waker.before(["model.layers.0.self_attn.v_proj.weight"])  # already mapped: nothing
    assert recorder.mapped == [starts[0]]
    waker.before(["model.layers.1.mlp.up_proj.weight"])
    assert recorder.mapped == [starts[0], starts[2]]
    assert not allocator.pointer_to_data[starts[0]].is_asleep and allocator.pointer_to_data[starts[1]].is_asleep
    waker.map_all()
    assert recorder.mapped == [starts[0], starts[2], starts[1]] and waker.left == 0 and waker.fallbacks == 0
    assert waker.mapped == [starts[0], starts[2], starts[1]] and waker.map_s >= 0


def test_a_name_it_cannot_place_maps_everything_left(layout):
    allocator, params, recorder, starts, cumem = layout
    waker = waker_of(allocator, params, cumem)
    waker.before(["model.norm.weight"])
    waker.before(["lm_head.weight"])  # not among the parameters (a tied head, another model)
    assert sorted(recorder.mapped) == sorted(starts[:3]) and waker.fallbacks == 1 and waker.left == 0
    waker.before(["model.embed_tokens.weight"])
    assert len(recorder.mapped) == 3


def test_optional_names_map_only_where_the_model_has_them(layout):
    allocator, params, recorder, starts, cumem = layout
    params["model.layers.1.self_attn.qkv_proj.weight_scale_inv"] = params.pop("model.norm.weight")  # in range 2
    waker = waker_of(allocator, params, cumem)
    waker.before(["model.layers.1.self_attn.q_proj.weight"],
                 ["model.layers.1.self_attn.q_proj.weight_scale_inv", "model.embed_tokens.weight_scale_inv"])
    assert sorted(recorder.mapped) == sorted([starts[1], starts[2]]) and waker.fallbacks == 0


def test_hand_over_makes_vllms_wake_up_map_only_the_rest(layout):
    allocator, params, recorder, starts, cumem = layout
    waker = waker_of(allocator, params, cumem)
    waker.before(["model.layers.0.mlp.gate_proj.weight"])
    waker.map_all()
    waker.hand_over()
    assert recorder.mapped[0] == starts[1] and sorted(recorder.mapped[1:]) == sorted([starts[0], starts[2]])
    allocator.wake_up(tags=None)  # as vLLM's worker calls it: everything asleep comes back
    assert recorder.mapped[3:] == [starts[3]]  # only the KV cache's range
    assert "wake_up" not in vars(allocator)  # one use: the next wake-up is vLLM's own
    assert all(not d.is_asleep for d in allocator.pointer_to_data.values())
    assert len(allocator.pointer_to_data) == 4


class _AllocatorWithoutAsleepFlag:
    """A fake of the vLLM builds whose ``CuMemAllocator`` keeps no ``is_asleep`` per allocation: its
    ``wake_up`` maps every allocation of the tags asked for (vLLM 0.26's loop)."""

    def __init__(self, allocator: Any, create_and_map: Any) -> None:
        self.pointer_to_data = {p: _Data(d.handle, d.tag) for p, d in allocator.pointer_to_data.items()}
        self._map = create_and_map

    def wake_up(self, tags: list[str] | None = None) -> None:
        for data in self.pointer_to_data.values():
            if tags is None or data.tag in tags:
                self._map(data.handle)


class _Data:
    def __init__(self, handle: Any, tag: str) -> None:
        self.handle, self.tag = handle, tag


def test_hand_over_where_vllm_keeps_no_asleep_flag(layout):
    allocator, params, recorder, starts, cumem = layout
    old = _AllocatorWithoutAsleepFlag(allocator, cumem.create_and_map)
    waker = waker_of(old, params, cumem)
    assert waker.left == 3  # without the flag every range of the tag counts released
    waker.before(["model.layers.1.self_attn.v_proj.weight"])
    waker.map_all()
    waker.hand_over()
    old.wake_up(["weights"])
    assert len(recorder.mapped) == 3 and sorted(recorder.mapped) == sorted(starts[:3])  # nothing twice
    old.wake_up(["weights"])  # the next one is its own again
    assert len(recorder.mapped) == 6


def test_release_gives_back_what_was_mapped(layout):
    allocator, params, recorder, starts, cumem = layout
    waker = waker_of(allocator, params, cumem)
    waker.before(["model.embed_tokens.weight", "model.norm.weight"])
    waker.release()
    assert sorted(recorder.released) == sorted([starts[0], starts[2]]) and waker.left == 3 and not waker.mapped
    assert all(d.is_asleep for d in allocator.pointer_to_data.values())
