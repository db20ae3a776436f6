"""Waking vLLM's sleeping memory in several threads (CUDA virtual memory, through ``ctypes``).

vLLM's sleep mode keeps every allocation of its ``CuMemAllocator`` as a reserved address range
and, while asleep, no physical memory behind it. ``wake_up`` gives each range its memory back with
``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``, one allocation after the other, holding
Python's GIL all the while (vLLM's C extension does not release it). For a 14B model that is a few
hundred allocations and ~30 GB, and the driver's work on them is most of a refit's wake-up.

:func:`map_allocations` does the same three calls for many allocations in ``threads`` threads.
``ctypes`` releases the GIL around each foreign call, so the threads' driver calls overlap as far
as the driver lets them. It writes each new handle where vLLM's extension keeps it (the handle
pointer of vLLM's allocation tuple), so vLLM's own ``sleep`` and ``free`` later release exactly
what was created here. :func:`threaded_wake` wraps a ``CuMemAllocator``'s ``wake_up`` with it
(allocations that come back from a CPU backup, i.e. a level-1 sleep's weights, still go through
vLLM's own path: their copy dominates, not the mapping).

Nothing here imports vLLM or needs torch: the benchmark ``benchmarks/vmm_wake.py`` drives it
directly.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger("rollout_engines.vllm.vmm")

#: vLLM's allocation tuple (CUDA): (device, size, device pointer, address of the handle slot).
Allocation = tuple[int, int, int, int]

_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed (the driver's error name and text in the message)."""


class Driver:
    """The few CUDA driver calls this module makes, on ``libcuda.so.1``."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        lib = ctypes.CDLL(library)
        u64, size_t, vp = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p
        signatures: dict[str, list[Any]] = {
            "cuCtxGetCurrent": [ctypes.POINTER(vp)],
            "cuCtxSetCurrent": [vp],
            "cuMemCreate": [ctypes.POINTER(u64), size_t, ctypes.POINTER(_AllocationProp), u64],
            "cuMemMap": [u64, size_t, size_t, u64, u64],
            "cuMemSetAccess": [u64, size_t, ctypes.POINTER(_AccessDesc), size_t],
            "cuMemUnmap": [u64, size_t],
            "cuMemRelease": [u64],
            "cuMemAddressReserve": [ctypes.POINTER(u64), size_t, size_t, u64, u64],
            "cuMemAddressFree": [u64, size_t],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, args in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
            setattr(self, "_" + name, fn)

    def check(self, result: int, what: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self._cuGetErrorString(result, ctypes.byref(text))  # type: ignore[attr-defined]
            raise CudaDriverError(f"{what} failed: CUDA error {result} ({(text.value or b'?').decode()})")

    def current_context(self) -> int:
        ctx = ctypes.c_void_p()
        self.check(self._cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")  # type: ignore[attr-defined]
        if not ctx.value:
            raise CudaDriverError("no CUDA context is current in this thread (initialize the device first)")
        return int(ctx.value)

    def set_context(self, ctx: int) -> None:
        self.check(self._cuCtxSetCurrent(ctypes.c_void_p(ctx)), "cuCtxSetCurrent")  # type: ignore[attr-defined]

    def create(self, device: int, size: int, handle_slot: int) -> None:
        prop = _AllocationProp(type=_PINNED, location=_Location(_DEVICE, device))  # compression none
        slot = ctypes.cast(ctypes.c_void_p(handle_slot), ctypes.POINTER(ctypes.c_ulonglong))
        self.check(self._cuMemCreate(slot, size, ctypes.byref(prop), 0), "cuMemCreate")  # type: ignore[attr-defined]

    def map(self, device: int, size: int, ptr: int, handle_slot: int) -> None:
        handle = ctypes.c_ulonglong.from_address(handle_slot).value
        self.check(self._cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")  # type: ignore[attr-defined]

    def allow(self, device: int, size: int, ptr: int) -> None:
        desc = _AccessDesc(location=_Location(_DEVICE, device), flags=_READ_WRITE)
        self.check(self._cuMemSetAccess(ptr, size, ctypes.byref(desc), 1), "cuMemSetAccess")  # type: ignore[attr-defined]

    def create_and_map(self, allocation: Allocation) -> None:
        """vLLM's ``create_and_map`` (CUDA): physical memory for one reserved range."""
        device, size, ptr, slot = allocation
        self.create(device, size, slot)
        try:
            self.map(device, size, ptr, slot)
        except BaseException:
            self._cuMemRelease(ctypes.c_ulonglong.from_address(slot).value)  # type: ignore[attr-defined]
            raise
        self.allow(device, size, ptr)

    def unmap_and_release(self, allocation: Allocation) -> None:
        device, size, ptr, slot = allocation
        self.check(self._cuMemUnmap(ptr, size), "cuMemUnmap")  # type: ignore[attr-defined]
        self.check(self._cuMemRelease(ctypes.c_ulonglong.from_address(slot).value), "cuMemRelease")  # type: ignore[attr-defined]

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_ulonglong()
        self.check(self._cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")  # type: ignore[attr-defined]
        return int(ptr.value)

    def free_range(self, ptr: int, size: int) -> None:
        self.check(self._cuMemAddressFree(ptr, size), "cuMemAddressFree")  # type: ignore[attr-defined]


@functools.cache
def driver() -> Driver:
    return Driver()


def balanced(allocations: Sequence[Allocation], parts: int) -> list[list[Allocation]]:
    """``allocations`` in ``parts`` lists of about equal bytes (largest first, each to the lightest
    list); every list keeps the order the allocations came in."""
    parts = max(1, min(parts, len(allocations)))
    loads = [0] * parts
    owner: dict[int, int] = {}
    for i in sorted(range(len(allocations)), key=lambda i: -allocations[i][1]):
        k = loads.index(min(loads))
        loads[k] += allocations[i][1]
        owner[i] = k
    out: list[list[Allocation]] = [[] for _ in range(parts)]
    for i, allocation in enumerate(allocations):
        out[owner[i]].append(allocation)
    return [part for part in out if part]


def map_allocations(allocations: Sequence[Allocation], threads: int, *, drv: Driver | None = None,
                    done: Callable[[Allocation], None] | None = None) -> None:
    """``create_and_map`` every allocation, in ``threads`` threads (the calling thread's CUDA
    context made current in each). ``done(allocation)`` runs (in the worker thread, under a lock)
    after each one is mapped. The first failure is raised once every thread stopped; allocations
    mapped before it stay mapped (and were reported to ``done``)."""
    drv = drv or driver()
    if not allocations:
        return
    lock = threading.Lock()
    if threads <= 1 or len(allocations) == 1:
        for allocation in allocations:
            drv.create_and_map(allocation)
            if done is not None:
                done(allocation)
        return
    ctx = drv.current_context()
    failed = threading.Event()

    def run(part: list[Allocation]) -> None:
        drv.set_context(ctx)
        for allocation in part:
            if failed.is_set():
                return
            try:
                drv.create_and_map(allocation)
            except BaseException:
                failed.set()
                raise
            if done is not None:
                with lock:
                    done(allocation)

    parts = balanced(allocations, threads)
    with ThreadPoolExecutor(len(parts), thread_name_prefix="roe-wake") as pool:
        futures = [pool.submit(run, part) for part in parts]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]  # type: ignore[misc]


def threaded_wake(allocator: Any, threads: int, *, drv: Driver | None = None) -> None:
    """Make ``allocator.wake_up`` (a vLLM ``CuMemAllocator``) map the allocations that come back
    empty (asleep, of a woken tag, no CPU backup) in ``threads`` threads, then run vLLM's own
    ``wake_up`` for the rest (CPU backups, tags vLLM always wakes, its bookkeeping) with the ones
    already mapped set aside, so that none is mapped twice."""
    original = getattr(allocator.wake_up, "roe_original", allocator.wake_up)

    def wake_up(tags: list[str] | None = None) -> None:
        table = allocator.pointer_to_data
        empty: dict[Allocation, Any] = {}
        for data in table.values():
            handle = data.handle
            if (getattr(data, "is_asleep", False) and (tags is None or data.tag in tags)
                    and data.cpu_backup_tensor is None and len(handle) == 4 and isinstance(handle[3], int)):
                empty[tuple(handle)] = data  # type: ignore[index]
        woken: dict[int, Any] = {}

        def mark(allocation: Allocation) -> None:
            empty[allocation].is_asleep = False
            woken[allocation[2]] = empty[allocation]

        try:
            map_allocations(list(empty), threads, drv=drv, done=mark)
        except CudaDriverError as exc:  # vLLM's own wake-up below maps what is left, or fails as it would
            logger.warning("threaded wake-up stopped (%s); vLLM's wake_up maps the rest", exc)
        for ptr in woken:
            table.pop(ptr, None)
        try:
            original(tags)
        finally:
            table.update(woken)

    wake_up.roe_threads = threads  # type: ignore[attr-defined]
    wake_up.roe_original = original  # type: ignore[attr-defined]
    allocator.wake_up = wake_up
