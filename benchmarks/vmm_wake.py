"""What a level-2 wake-up of a model's weights costs in CUDA driver calls, one thread against many.

vLLM's sleep mode gives every weight allocation its memory back with ``cuMemCreate`` +
``cuMemMap`` + ``cuMemSetAccess`` (its ``CuMemAllocator``, a C extension that holds Python's GIL),
one allocation after another. The same driver calls are made here through ``ctypes``, which lets
go of the GIL during each call, so threads can overlap them as far as the driver lets them.
This reserves the address ranges of a model shape's allocations as vLLM's loader makes them (fused
``qkv_proj`` / ``gate_up_proj``, one allocation per large tensor, sizes rounded to the 2 MiB
granularity), then times, over ``--repeats`` rounds each: mapping them all in one thread (vLLM's
way), each driver call's share of that, and mapping them in 2, 4, 8 and 16 threads; and releasing
them (a sleep's work). ``--delays`` then times the single-thread mapping again after waiting
that many seconds after the last release (does the driver finish something in the background?).
``--merged K`` merges the allocations, in order, into K (would a loader that packs the weights
into few allocations wake them faster?). ``--settle`` also checks, after each release, whether the
device reports the released bytes free (and how long until it does), then maps again.
``--after-pause`` follows a refit's order: memory mapped right after a release (or after a rest)
stays mapped P seconds, then is released and mapped again at once; with ``--kv-mb M`` the same
rounds run again with M MiB of KV cache in one allocation per layer, mapped after the weights and
released right after them, as a vLLM engine's wake-ups and sleep do (the weights' mapping is timed);
``--free-gb G`` runs them once more with the device filled but for G GB beyond what they map, and
then the ``--delays`` rounds on that full device (does a rest after the release help there too?),
and those rounds again with a trainer's step before each wait: the memory the release gave back
taken by one tensor and freed (is memory a trainer has just freed as slow to map again?).
Needs a CUDA GPU; prints one JSON line.

    python benchmarks/vmm_wake.py --shape qwen3-14b
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


def balanced(allocations: Sequence[Allocation], parts: int) -> list[list[Allocation]]:
    """``allocations`` in ``parts`` lists of about equal bytes (largest first, each to the lightest)."""
    out: list[list[Allocation]] = [[] for _ in range(max(1, min(parts, len(allocations))))]
    loads = [0] * len(out)
    for allocation in sorted(allocations, key=lambda a: -a[1]):
        k = loads.index(min(loads))
        loads[k] += allocation[1]
        out[k].append(allocation)
    return out


def map_allocations(allocations: Sequence[Allocation], threads: int, drv: Driver) -> None:
    """``create_and_map`` every allocation, in ``threads`` threads (the calling thread's CUDA
    context made current in each); a failure is raised once every thread stopped."""
    if threads <= 1:
        for allocation in allocations:
            drv.create_and_map(allocation)
        return
    ctx = drv.current_context()

    def run(part: list[Allocation]) -> None:
        drv.set_context(ctx)
        for allocation in part:
            drv.create_and_map(allocation)

    with ThreadPoolExecutor(threads, thread_name_prefix="roe-wake") as pool:
        futures = [pool.submit(run, part) for part in balanced(allocations, threads)]
    for future in futures:
        future.result()


GRANULARITY = 2 << 20
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, head dim, vocabulary
    "qwen3-14b": (5120, 17408, 40, 40, 8, 128, 151936),
}


def allocation_sizes(shape: str, itemsize: int = 2) -> list[int]:
    h, inter, layers, heads, kv, hd, vocab = SHAPES[shape]
    per_layer = [(heads + 2 * kv) * hd * h, heads * hd * h, 2 * inter * h, inter * h]
    sizes = [vocab * h] + per_layer * layers + [vocab * h]
    small = (2 * h + 2 * hd + (heads + 2 * kv) * hd) * layers + h  # norms and biases: 2 MiB blocks
    sizes = [n * itemsize for n in sizes] + [GRANULARITY] * max(1, small * itemsize // GRANULARITY + 1)
    return [-(-s // GRANULARITY) * GRANULARITY for s in sizes]


def merged(sizes: Sequence[int], parts: int) -> list[int]:
    """``sizes`` merged, in order, into at most ``parts`` allocations of about equal bytes (0:
    unmerged): one cut wherever the running total crosses the next multiple of
    ``sum(sizes) / parts`` (fewer where one allocation spans two of them)."""
    if parts <= 0 or parts >= len(sizes):
        return list(sizes)
    target = sum(sizes) / parts
    out: list[int] = []
    running = current = 0
    for size in sizes:
        current += size
        running += size
        if len(out) < parts - 1 and running >= (len(out) + 1) * target:
            out.append(current)
            current = 0
    if current:
        out.append(current)
    return out


def settle(allocations: Sequence[Allocation], drv: Driver, repeats: int, map_all: Any, touch: Any,
           release: Any, slack: int = 256 << 20, limit_s: float = 2.0) -> dict[str, Any]:
    """After each release: how many of the released bytes the device reports free at once, how long
    until it reports them all free (``slack`` short), and how long the mapping then takes."""
    import torch

    total = sum(a[1] for a in allocations)
    rounds: list[dict[str, float]] = []
    for _ in range(repeats):
        free_before = torch.cuda.mem_get_info()[0]
        map_all(allocations, 1, drv)
        touch()
        released_s = release()
        t0 = time.perf_counter()
        free_now = torch.cuda.mem_get_info()[0]
        polls = 0
        while free_now < free_before - slack and time.perf_counter() - t0 < limit_s:
            time.sleep(0.0005)
            free_now = torch.cuda.mem_get_info()[0]
            polls += 1
        settled_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        map_all(allocations, 1, drv)
        mapped_s = time.perf_counter() - t1
        touch()
        release()
        time.sleep(0.5)  # the next round starts from a device that has its memory back
        rounds.append({"release_ms": round(released_s * 1e3, 2), "settle_ms": round(settled_s * 1e3, 2),
                       "polls": polls, "free_short_gb_at_settle": round((free_before - free_now) / 1e9, 3),
                       "map_after_settle_ms": round(mapped_s * 1e3, 2)})
    free_at_once = []
    for _ in range(repeats):  # right after the release calls return: how much is free already?
        free_before = torch.cuda.mem_get_info()[0]
        map_all(allocations, 1, drv)
        touch()
        release()
        free_at_once.append(round((free_before - torch.cuda.mem_get_info()[0]) / total, 3))
        time.sleep(0.5)
    return {"rounds": rounds, "short_fraction_right_after_release": free_at_once}


def after_pause(allocations: Sequence[Allocation], drv: Driver, repeats: int, pauses: Sequence[float],
                map_all: Any, touch: Any, release: Any, map_rest: Any = None) -> dict[str, Any]:
    """A refit's order, per pause P: the memory mapped right after a release (as a wake-up right
    after a sleep maps it), then P seconds with it mapped (the engine serving), then released and,
    at once, mapped again (timed). And, for comparison, the same with the first mapping made on a
    device that rested 0.5 s after the release before it. Does memory mapped right after a release
    stay slow to map again once released, however long it stayed mapped? ``map_rest`` (untimed)
    follows every mapping of ``allocations`` (the KV cache's wake-up after the weights'); ``release``
    then releases both."""
    out: dict[str, Any] = {}

    def map_weights() -> None:
        map_all(allocations, 1, drv)
        if map_rest is not None:
            map_rest()

    for rested in (False, True):
        for pause in pauses:
            times = []
            for _ in range(repeats):  # each round starts and ends with the memory released
                map_weights()
                touch()
                release()
                if rested:
                    time.sleep(0.5)
                map_weights()
                touch()
                time.sleep(pause)
                release()
                t0 = time.perf_counter()
                map_all(allocations, 1, drv)
                times.append(round((time.perf_counter() - t0) * 1e3, 2))
                if map_rest is not None:
                    map_rest()
                touch()
                release()
            out[f"{'rested' if rested else 'right_after_release'}_then_{pause}s_mapped"] = times
    return out


def delay_rounds(allocations: Sequence[Allocation], drv: Driver, repeats: int, delays: Sequence[float],
                 map_all: Any, touch: Any, release: Any, map_rest: Any = None,
                 releases: list[float] | None = None, before: Any = None) -> dict[str, list[float]]:
    """Per delay D, ``repeats`` rounds that start with the memory released: ``before()`` where given
    (a trainer's step in the memory just released), wait D seconds, map ``allocations`` (timed;
    ``map_rest`` follows, untimed), touch, release. The milliseconds of each timed mapping by delay;
    each release's seconds go to ``releases`` where given."""
    out: dict[str, list[float]] = {}
    for delay in delays:
        for _ in range(repeats):
            if before is not None:
                before()
            time.sleep(delay)
            synchronize()
            t0 = time.perf_counter()
            map_all(allocations, 1, drv)
            out.setdefault(str(delay), []).append(round((time.perf_counter() - t0) * 1e3, 2))
            if map_rest is not None:
                map_rest()
            touch()
            seconds = release()
            if releases is not None:
                releases.append(seconds)
    return out


def synchronize() -> None:
    """Wait for the GPU's queued work (nothing to wait for without CUDA)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def filler_bytes(free: int, need: int, keep: int) -> int:
    """How many bytes to allocate so that, of ``free`` bytes, ``need`` and ``keep`` more stay free
    (0 where not even that many are free)."""
    return max(0, free - need - keep)


def kv_sizes(shape: str, total: int) -> list[int]:
    """``total`` bytes of KV cache as one allocation per layer of ``shape`` (vLLM's layout: one KV
    tensor per attention layer), each rounded up to the driver's granularity."""
    layers = SHAPES[shape][2]
    return [-(-max(1, total // layers) // GRANULARITY) * GRANULARITY] * layers


def reserve(sizes: Sequence[int], device: int, drv: Driver) -> tuple[list[Allocation], Any]:
    """An address range reserved for each size, and the handle slots they use (keep them alive)."""
    slots = (ctypes.c_ulonglong * len(sizes))()
    base = ctypes.addressof(slots)
    return [(device, size, drv.reserve(size), base + 8 * i) for i, size in enumerate(sizes)], slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-14b", choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--merged", type=int, default=0,
                        help="merge the shape's allocations, in order, into this many (0: as vLLM makes them): "
                        "would a loader that packs the weights into few allocations wake them faster?")
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--delays", default="0,0.05,0.2,0.5,1,2",
                        help="seconds between a release and the next mapping (one thread), comma-separated")
    parser.add_argument("--settle", action="store_true",
                        help="also, after each release, poll the device's free memory until the released "
                        "bytes are back (at most 2 s), then map again: is the slow mapping right after a "
                        "release the driver still giving that memory back, and can a sleep wait for it?")
    parser.add_argument("--after-pause", default="",
                        help="also, for each of these seconds P (comma-separated): map right after a release, "
                        "stay mapped P seconds, release and map again at once (timed); the same with the first "
                        "mapping made after a 0.5 s rest")
    parser.add_argument("--kv-mb", type=int, default=0,
                        help="with --after-pause: run its rounds again with this many MiB of KV cache, one "
                        "allocation per layer, mapped after the weights and released right after them (as a "
                        "vLLM engine's wake-ups and sleep do)")
    parser.add_argument("--free-gb", type=float, default=None,
                        help="with --after-pause: run its rounds once more (with the --kv-mb cache, if given) with the "
                        "device filled but for this many GB beyond what they map, as a colocated trainer and engine "
                        "keep it")
    args = parser.parse_args()
    if args.kv_mb < 0 or (args.kv_mb and not args.after_pause):
        parser.error("--kv-mb takes a size in MiB >= 0, and only with --after-pause")
    if args.free_gb is not None and (args.free_gb < 0 or not args.after_pause):
        parser.error("--free-gb takes a size in GB >= 0, and only with --after-pause")
    import torch

    torch.zeros(1, device="cuda")  # the primary context, current in this thread
    device = torch.cuda.current_device()
    drv = Driver()
    sizes = merged(allocation_sizes(args.shape), args.merged)
    allocations, _slots = reserve(sizes, device, drv)
    total = sum(sizes)
    out: dict = {"shape": args.shape, "allocations": len(sizes), "bytes": total, "gpu": torch.cuda.get_device_name()}

    def release() -> float:
        t0 = time.perf_counter()
        for allocation in allocations:
            drv.unmap_and_release(allocation)
        return time.perf_counter() - t0

    memset = ctypes.CDLL("libcuda.so.1").cuMemsetD8_v2
    memset.argtypes, memset.restype = [ctypes.c_ulonglong, ctypes.c_ubyte, ctypes.c_size_t], ctypes.c_int

    def touch() -> None:  # a write through every 16th mapping proves they are there
        for _, size, ptr, _ in allocations[:: max(1, len(allocations) // 16)]:
            drv.check(memset(ptr, 0, min(size, 1 << 20)), "cuMemsetD8")
        torch.cuda.synchronize()

    phases: dict[str, list[float]] = {"create": [], "map": [], "access": []}
    releases: list[float] = []
    for _ in range(args.repeats):  # one thread, call by call
        t0 = time.perf_counter()
        for d, size, _ptr, slot in allocations:
            drv.create(d, size, slot)
        t1 = time.perf_counter()
        for d, size, ptr, slot in allocations:
            drv.map(d, size, ptr, slot)
        t2 = time.perf_counter()
        for d, size, ptr, _slot in allocations:
            drv.allow(d, size, ptr)
        t3 = time.perf_counter()
        touch()
        phases["create"].append(t1 - t0)
        phases["map"].append(t2 - t1)
        phases["access"].append(t3 - t2)
        releases.append(release())
    out["serial_phases_median_ms"] = {k: round(statistics.median(v) * 1e3, 2) for k, v in phases.items()}
    runs: dict[str, dict] = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            map_allocations(allocations, threads, drv)
            times.append(time.perf_counter() - t0)
            touch()
            releases.append(release())
        med = statistics.median(times)
        runs[str(threads)] = {"median_ms": round(med * 1e3, 2), "best_ms": round(min(times) * 1e3, 2),
                              "gbps": round(total / med / 1e9, 1)}
        print(f"threads={threads} {runs[str(threads)]}", flush=True)
    out["map"] = runs
    delays = [float(d) for d in args.delays.split(",") if d]
    out["delay_s_to_map_ms"] = delay_rounds(allocations, drv, args.repeats, delays, map_allocations, touch,
                                            release, releases=releases)
    if args.settle:
        out["settle"] = settle(allocations, drv, args.repeats, map_allocations, touch, release)
    if args.after_pause:
        pauses = [float(p) for p in args.after_pause.split(",") if p]
        out["after_pause_map_ms"] = after_pause(allocations, drv, args.repeats, pauses, map_allocations, touch,
                                                release)
        kv: list[Allocation] = []
        rounds: tuple[Any, Any] = (release, None)
        if args.kv_mb:
            kv, _kv_slots = reserve(kv_sizes(args.shape, args.kv_mb << 20), device, drv)

            def release_both() -> float:
                t0 = time.perf_counter()
                release()
                for allocation in kv:
                    drv.unmap_and_release(allocation)
                return time.perf_counter() - t0

            rounds = (release_both, lambda: map_allocations(kv, 1, drv))
            out["kv_allocations"] = len(kv)
            out["kv_bytes"] = sum(a[1] for a in kv)
            out["after_pause_with_kv_map_ms"] = after_pause(allocations, drv, args.repeats, pauses, map_allocations,
                                                            touch, *rounds)
        if args.free_gb is not None:  # the device as full as a colocated trainer and engine keep it
            need = total + sum(a[1] for a in kv)
            fill = filler_bytes(torch.cuda.mem_get_info()[0], need, int(args.free_gb * 1e9))
            filler = torch.empty(fill, dtype=torch.uint8, device="cuda")
            filler.fill_(1)
            torch.cuda.synchronize()
            out["filler_bytes"] = fill
            out["free_beyond_need_gb"] = round((torch.cuda.mem_get_info()[0] - need) / 1e9, 3)
            out["after_pause_full_device_map_ms"] = after_pause(allocations, drv, args.repeats, pauses,
                                                                map_allocations, touch, *rounds)
            # and with a rest between the release and the mapping (a trainer's step between a sleep
            # and a wake-up): does the full device's memory come back fast after a rest?
            out["full_device_delay_s_to_map_ms"] = delay_rounds(allocations, drv, args.repeats, delays,
                                                                map_allocations, touch, *rounds)

            def trainer_step() -> None:  # the trainer takes the memory the sleep gave back, then frees it
                step = torch.empty(need, dtype=torch.uint8, device="cuda")
                step.fill_(2)
                torch.cuda.synchronize()
                del step
                torch.cuda.empty_cache()

            # a colocated loop: the engine sleeps, the trainer trains in what it released and frees
            # that memory, and the engine wakes D seconds later
            out["full_device_after_trainer_map_ms"] = delay_rounds(allocations, drv, args.repeats, delays,
                                                                   map_allocations, touch, *rounds,
                                                                   before=trainer_step)
            del filler
            torch.cuda.empty_cache()
        for _, size, ptr, _ in kv:
            drv.free_range(ptr, size)
    out["release_median_ms"] = round(statistics.median(releases) * 1e3, 2)
    one = runs.get("1", {}).get("median_ms")
    if one:
        out["speedup"] = {k: round(one / v["median_ms"], 2) for k, v in runs.items()}
    for _, size, ptr, _ in allocations:
        drv.free_range(ptr, size)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
