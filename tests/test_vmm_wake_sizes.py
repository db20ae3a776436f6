"""`benchmarks/vmm_wake.py`'s allocation plans (the GPU part needs CUDA; its sizes do not): the 14B
shape's allocations as vLLM's loader makes them, their merge into fewer, and the threads' shares."""

from __future__ import annotations

import pytest
from repo_scripts import load_script

vmm_wake = load_script("benchmarks/vmm_wake.py")


def test_the_14b_shape_has_its_weights_allocations_at_the_driver_granularity():
    sizes = vmm_wake.allocation_sizes("qwen3-14b")
    assert len(sizes) == 163  # 2 embeddings, 4 fused matrices a layer, the small tensors' 2 MiB blocks
    assert all(s % vmm_wake.GRANULARITY == 0 and s > 0 for s in sizes)
    assert 29.4e9 < sum(sizes) < 29.7e9  # the 14B shape's 29.5 GB in bf16, rounded up per allocation


@pytest.mark.parametrize("parts", [1, 2, 3, 8, 40])
def test_merged_keeps_every_byte_in_order_in_at_most_that_many_allocations(parts):
    sizes = vmm_wake.allocation_sizes("qwen3-14b")
    out = vmm_wake.merged(sizes, parts)
    assert sum(out) == sum(sizes)
    assert len(out) == parts if parts <= 8 else parts // 2 < len(out) <= parts
    # each merged allocation is a run of whole consecutive allocations
    edges, running = set(), 0
    for size in sizes:
        running += size
        edges.add(running)
    running = 0
    for size in out:
        running += size
        assert running in edges
    # about equal bytes: none more than one (largest) allocation above the mean
    assert max(out) <= sum(sizes) / parts + max(sizes)


@pytest.mark.parametrize("parts", [0, 163, 500])
def test_merged_leaves_the_allocations_as_they_are_when_no_merge_is_asked(parts):
    sizes = vmm_wake.allocation_sizes("qwen3-14b")
    assert vmm_wake.merged(sizes, parts) == sizes


def test_balanced_shares_hold_every_allocation_once():
    allocations = [(0, size, i, i) for i, size in enumerate(vmm_wake.allocation_sizes("qwen3-14b"))]
    shares = vmm_wake.balanced(allocations, 4)
    assert len(shares) == 4
    assert sorted(a for share in shares for a in share) == sorted(allocations)
    loads = [sum(a[1] for a in share) for share in shares]
    assert max(loads) - min(loads) <= max(a[1] for a in allocations)
