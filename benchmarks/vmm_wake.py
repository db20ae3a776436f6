"""What a level-2 wake-up of a model's weights costs in CUDA driver calls, one thread against many.

vLLM's sleep mode gives every weight allocation its memory back with ``cuMemCreate`` +
``cuMemMap`` + ``cuMemSetAccess`` (``rollout_engines_vllm.vmm``), one allocation after another.
This reserves the address ranges of a model shape's allocations as vLLM's loader makes them (fused
``qkv_proj`` / ``gate_up_proj``, one allocation per large tensor, sizes rounded to the 2 MiB
granularity), then times, over ``--repeats`` rounds each: mapping them all in one thread (vLLM's
way), each driver call's share of that, and mapping them in 2, 4, 8 and 16 threads; and releasing
them (a sleep's work). Needs a CUDA GPU; prints one JSON line.

    PYTHONPATH=plugins/vllm python benchmarks/vmm_wake.py --shape qwen3-14b
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-14b", choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2,4,8,16")
    args = parser.parse_args()
    import torch
    from rollout_engines_vllm.vmm import Driver, map_allocations

    torch.zeros(1, device="cuda")  # the primary context, current in this thread
    device = torch.cuda.current_device()
    drv = Driver()
    sizes = allocation_sizes(args.shape)
    slots = (ctypes.c_ulonglong * len(sizes))()
    base = ctypes.addressof(slots)
    allocations = [(device, size, drv.reserve(size), base + 8 * i) for i, size in enumerate(sizes)]
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
            map_allocations(allocations, threads, drv=drv)
            times.append(time.perf_counter() - t0)
            touch()
            releases.append(release())
        med = statistics.median(times)
        runs[str(threads)] = {"median_ms": round(med * 1e3, 2), "best_ms": round(min(times) * 1e3, 2),
                              "gbps": round(total / med / 1e9, 1)}
        print(f"threads={threads} {runs[str(threads)]}", flush=True)
    out["map"] = runs
    out["release_median_ms"] = round(statistics.median(releases) * 1e3, 2)
    one = runs.get("1", {}).get("median_ms")
    if one:
        out["speedup"] = {k: round(one / v["median_ms"], 2) for k, v in runs.items()}
    for _, size, ptr, _ in allocations:
        drv.free_range(ptr, size)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
