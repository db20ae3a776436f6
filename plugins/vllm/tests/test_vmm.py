"""The threaded wake-up (``wake_threads``, :mod:`rollout_engines_vllm.vmm`): which allocations it
maps, that none is mapped twice beside vLLM's own ``wake_up``, and what a failed driver call
leaves. The CUDA driver does not run on this machine, so ``FakeDriver`` stands in for it (named
as a fake): it records each range it maps, refuses a range mapped twice, and fails where told. The
real driver calls are measured on a GPU by ``benchmarks/vmm_wake.py`` and ``bench refit
--option wake_threads=N``."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest
from rollout_engines_vllm.vmm import CudaDriverError, balanced, map_allocations, threaded_wake


class FakeDriver:
    """A fake CUDA driver: maps address ranges in a set, from any thread."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.mapped: set[int] = set()
        self.threads: set[str] = set()
        self.contexts: list[int] = []
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def current_context(self) -> int:
        return 42

    def set_context(self, ctx: int) -> None:
        with self.lock:
            self.contexts.append(ctx)

    def create_and_map(self, allocation: tuple[int, int, int, int]) -> None:
        ptr = allocation[2]
        with self.lock:
            if ptr == self.fail_at:
                raise CudaDriverError("cuMemCreate failed: CUDA error 2 (out of memory)")
            if ptr in self.mapped:
                raise CudaDriverError(f"cuMemMap failed: range {ptr:#x} is already mapped")
            self.mapped.add(ptr)
            self.threads.add(threading.current_thread().name)


@dataclass
class Data:  # vLLM's AllocationData, the fields its wake_up reads
    handle: Any
    tag: str
    is_asleep: bool = True
    cpu_backup_tensor: Any = None


class Allocator:
    """vLLM 0.26's ``CuMemAllocator.wake_up`` as it reads its table: every allocation of a named
    tag is created and mapped again (it does not look at ``is_asleep``), through ``driver``."""

    def __init__(self, driver: FakeDriver, table: dict[int, Data]) -> None:
        self.driver, self.pointer_to_data, self.calls = driver, table, []

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append((tags, sorted(self.pointer_to_data)))
        for data in self.pointer_to_data.values():
            if tags is None or data.tag in tags:
                self.driver.create_and_map(data.handle)
                data.is_asleep = False
                data.cpu_backup_tensor = None


def table(n_weights: int = 12, n_kv: int = 3, backups: int = 2) -> dict[int, Data]:
    out = {}
    for i in range(n_weights):
        ptr = 0x1000 * (i + 1)
        out[ptr] = Data((0, (i % 5 + 1) << 21, ptr, 0), "weights", cpu_backup_tensor=object() if i < backups else None)
    for i in range(n_kv):
        ptr = 0x100000 * (i + 1)
        out[ptr] = Data((0, 1 << 24, ptr, 0), "kv_cache")
    return out


def test_balanced_keeps_order_and_evens_bytes() -> None:
    allocations = [(0, size, i, 0) for i, size in enumerate([9, 1, 1, 5, 4, 3, 3, 2])]
    parts = balanced(allocations, 3)
    assert sorted(a for part in parts for a in part) == sorted(allocations)
    assert all([a[2] for a in part] == sorted(a[2] for a in part) for part in parts)
    loads = [sum(a[1] for a in part) for part in parts]
    assert max(loads) - min(loads) <= 1, loads
    assert balanced(allocations[:2], 8) == [[allocations[0]], [allocations[1]]]


def test_map_allocations_in_threads_sets_the_context_in_each() -> None:
    drv = FakeDriver()
    allocations = [(0, 2 << 20, 0x1000 * i, 0) for i in range(1, 33)]
    done: list[int] = []
    map_allocations(allocations, 4, drv=drv, done=lambda a: done.append(a[2]))  # type: ignore[arg-type]
    assert drv.mapped == {a[2] for a in allocations}
    assert sorted(done) == sorted(drv.mapped)
    assert len(drv.threads) > 1 and all(name.startswith("roe-wake") for name in drv.threads)
    assert drv.contexts == [42] * 4


def test_threaded_wake_maps_each_allocation_once() -> None:
    drv = FakeDriver()
    t = table()
    alloc = Allocator(drv, t)
    threaded_wake(alloc, 4, drv=drv)  # type: ignore[arg-type]
    threaded_wake(alloc, 4, drv=drv)  # type: ignore[arg-type]  # installed twice: wraps vLLM's once
    alloc.wake_up(["weights"])
    weights = {p for p, d in t.items() if d.tag == "weights"}
    assert drv.mapped == weights  # the KV cache stays asleep, nothing was mapped twice
    assert all(not t[p].is_asleep for p in weights) and all(d.is_asleep for d in t.values() if d.tag == "kv_cache")
    # vLLM's own wake_up ran once, for the allocations with a CPU backup (and its bookkeeping) only
    [(tags, seen)] = alloc.calls
    assert tags == ["weights"]
    assert {p for p in seen if t[p].tag == "weights"} == {p for p in weights if p in (0x1000, 0x2000)}
    assert set(t) == weights | {p for p, d in t.items() if d.tag == "kv_cache"}  # the table is whole again
    assert len(drv.threads) > 1


def test_a_failed_map_leaves_the_rest_to_vllm(caplog: pytest.LogCaptureFixture) -> None:
    drv = FakeDriver(fail_at=0x5000)
    t = table(backups=0)
    alloc = Allocator(drv, t)
    threaded_wake(alloc, 1, drv=drv)  # type: ignore[arg-type]
    with pytest.raises(CudaDriverError, match="out of memory"):
        alloc.wake_up(["weights"])  # vLLM's own wake_up meets the same failure and raises it
    assert "threaded wake-up stopped" in caplog.text
    mapped_by_us = {0x1000, 0x2000, 0x3000, 0x4000}
    assert mapped_by_us <= drv.mapped  # mapped before the failure, and not mapped again by vLLM
    [(_, seen)] = alloc.calls
    assert not mapped_by_us & set(seen)
    assert set(t) >= mapped_by_us  # set back in the table
    assert all(not t[p].is_asleep for p in mapped_by_us)
