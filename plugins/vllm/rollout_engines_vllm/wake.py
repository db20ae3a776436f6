"""Waking a vLLM worker's weights with the push that fills them (``WeightSync.push(wake=True)``).

After ``sleep(level=2)`` vLLM's sleep-mode allocator (``CuMemAllocator``) holds the weights as
released ranges of virtual memory; its ``wake_up`` maps every range again, one driver call
sequence each (29.5 GB in ~160 ranges take 28-120 ms on an H200 or H100, benchmarks/RESULTS.md),
and only then may the push copy into them. The weights' old contents are gone either way, so a push
that wakes them can map each range just before the first bucket that writes into it: the range
for bucket ``k + 1`` is mapped while the GPU still copies bucket ``k``.

:class:`LazyWeightsWake` does that in the receiving thread: :meth:`~LazyWeightsWake.before` maps the
ranges under a bucket's parameters (all that are left, for a name it cannot place), and
:meth:`~LazyWeightsWake.finish` maps the rest. vLLM's engine core still counts the weights asleep
until its own ``wake_up(tags=["weights"])`` (which also restores the buffers a level-2 sleep
saved); :meth:`~LazyWeightsWake.hand_over` makes the allocator's next ``wake_up`` skip the ranges
mapped here, so that call maps nothing twice.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

logger = logging.getLogger("rollout_engines.vllm.wake")


def sleep_allocator() -> tuple[Any, Callable[[Any], None], Callable[[Any], None]] | None:
    """vLLM's sleep-mode allocator of this process with its map and unmap calls, or None (no sleep
    mode, or a build without the allocator: CPU)."""
    try:
        from vllm.device_allocator import cumem
    except Exception:  # noqa: BLE001 - a build without the allocator (CPU)
        return None
    instance = cumem.CuMemAllocator.instance
    if instance is None:
        return None
    return instance, cumem.create_and_map, cumem.unmap_and_release


class LazyWeightsWake:
    """Maps the released ``tag`` ranges of ``allocator`` (vLLM's ``CuMemAllocator``: its
    ``pointer_to_data`` of ``AllocationData`` with ``handle = (device, size, ptr, handle)`` and
    ``tag``) as the tensors of ``params`` that buckets write into need them.

    ``params``: the model's parameters and buffers by name (vLLM's names). ``packed``: the model's
    ``packed_modules_mapping`` (``qkv_proj -> [q_proj, k_proj, v_proj]``), by which a checkpoint
    name (``...q_proj.weight``) finds the fused parameter it is loaded into. ``create_and_map`` /
    ``unmap_and_release``: the allocator's calls on one handle."""

    def __init__(
        self, allocator: Any, params: Mapping[str, torch.Tensor], packed: Mapping[str, Iterable[str]], *,
        create_and_map: Callable[[Any], None], unmap_and_release: Callable[[Any], None], tag: str = "weights",
    ) -> None:
        self.allocator = allocator
        self._map, self._unmap = create_and_map, unmap_and_release
        released = sorted(
            (int(ptr), data) for ptr, data in allocator.pointer_to_data.items()
            if data.tag == tag and getattr(data, "is_asleep", True)
        )
        self._starts = [ptr for ptr, _ in released]
        self._ends = [ptr + int(data.handle[1]) for ptr, data in released]
        self._data = [data for _, data in released]
        self._left = len(released)
        self._done = [False] * len(released)
        self.mapped: list[int] = []  # the ranges mapped here, in order (their start pointers)
        self.map_s = 0.0  # seconds spent in the allocator's map calls
        self.fallbacks = 0  # buckets that mapped everything left (a name not placed)
        self._params = params
        self._fused = {part: fused for fused, parts in packed.items() for part in parts}
        self._ranges: dict[str, list[int] | None] = {}

    @property
    def left(self) -> int:
        """Ranges still released."""
        return self._left

    def _range_of(self, name: str) -> list[int] | None:
        """Indices of the ranges under the parameter ``name`` is loaded into (None: not placed)."""
        if name in self._ranges:
            return self._ranges[name]
        tensor = self._params.get(name)
        if tensor is None:
            parts = name.split(".")
            for i, part in enumerate(parts):
                fused = self._fused.get(part)
                if fused is not None:
                    tensor = self._params.get(".".join([*parts[:i], fused, *parts[i + 1:]]))
                    break
        found: list[int] | None = None
        if tensor is not None:
            start = tensor.data_ptr()
            end = start + tensor.numel() * tensor.element_size()
            i = max(bisect.bisect_right(self._starts, start) - 1, 0)
            found = []
            while i < len(self._starts) and self._starts[i] < end:
                if self._ends[i] > start:
                    found.append(i)
                i += 1
        self._ranges[name] = found
        return found

    def before(self, names: Iterable[str], optional: Iterable[str] = ()) -> None:
        """Map the ranges the tensors ``names`` are about to be written into (checkpoint names), and
        those under the ``optional`` names the model has (an FP8 weight's scales)."""
        if not self._left:
            return
        wanted: set[int] = set()
        for name in optional:
            wanted.update(i for i in self._range_of(name) or () if not self._done[i])
        for name in names:
            found = self._range_of(name)
            if found is None:
                self.fallbacks += 1
                self.map_all()
                return
            wanted.update(i for i in found if not self._done[i])
        for i in sorted(wanted):
            self._map_one(i)

    def map_all(self) -> None:
        """Map every range still released."""
        for i in range(len(self._done)):
            if not self._done[i]:
                self._map_one(i)

    def _map_one(self, i: int) -> None:
        data = self._data[i]
        start = time.perf_counter()
        self._map(data.handle)
        self.map_s += time.perf_counter() - start
        if hasattr(data, "is_asleep"):  # vLLM builds that track it skip mapped ranges themselves
            data.is_asleep = False
        self._done[i] = True
        self._left -= 1
        self.mapped.append(self._starts[i])

    def release(self) -> None:
        """Unmap what was mapped here (the weights stay asleep, as before the push)."""
        for i, done in enumerate(self._done):
            if done:
                try:
                    self._unmap(self._data[i].handle)
                except Exception as exc:  # noqa: BLE001 - keep releasing the others
                    logger.warning("could not release a weights range again: %s", exc)
                if hasattr(self._data[i], "is_asleep"):
                    self._data[i].is_asleep = True
                self._done[i] = False
                self._left += 1
        self.mapped.clear()

    def hand_over(self) -> None:
        """Make the allocator's next ``wake_up`` (vLLM's own, through its engine core) skip the
        ranges mapped here: it then maps nothing twice and restores what a level-2 sleep saved."""
        allocator, mapped = self.allocator, frozenset(self.mapped)
        wake_up = type(allocator).wake_up

        def wake_up_once(tags: list[str] | None = None) -> None:
            del allocator.wake_up  # one use: later wake-ups are vLLM's own again
            every = allocator.pointer_to_data
            allocator.pointer_to_data = {p: d for p, d in every.items() if p not in mapped}
            try:
                wake_up(allocator, tags)
            finally:
                allocator.pointer_to_data = every

        allocator.wake_up = wake_up_once
