"""How fast a GPU copies a state dict into separate tensors, by method; one JSON line.

    python benchmarks/copy_kernels.py [--size-mb 3072] [--tensors 320]

The limit under a receiver that copies into an engine's parameters: one flat copy of the same
bytes (the ``bench weight-sync`` baseline), ``torch._foreach_copy_`` eager and replayed from a
CUDA graph (what :class:`rollout_engines.weights.copies.SteadyCopier` does), a graph of one copy
node per tensor, and one eager ``copy_`` per tensor. Best of 7, GB/s of payload.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch


def best_seconds(fn: Callable[[], object], repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=float, default=3072)
    parser.add_argument("--tensors", type=int, default=320)
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    n = args.tensors
    per = int(args.size_mb * 2**20) // 4 // n
    src = [torch.randn(per, device=dev) for _ in range(n)]
    dst = [torch.empty(per, device=dev) for _ in range(n)]
    flat_src, flat_dst = torch.empty(n * per, device=dev), torch.empty(n * per, device=dev)
    per_tensor = torch.cuda.CUDAGraph()
    with torch.cuda.graph(per_tensor):
        for a, b in zip(dst, src, strict=True):
            a.copy_(b, non_blocking=True)
    foreach = torch.cuda.CUDAGraph()
    with torch.cuda.graph(foreach):
        torch._foreach_copy_(dst, src)
    runs = {
        "flat_copy": lambda: flat_dst.copy_(flat_src),
        "foreach_eager": lambda: torch._foreach_copy_(dst, src),
        "foreach_graph": foreach.replay,
        "per_tensor_graph": per_tensor.replay,
        "per_tensor_eager": lambda: [a.copy_(b, non_blocking=True) for a, b in zip(dst, src, strict=True)],
    }
    nbytes = n * per * 4
    out: dict[str, object] = {"bytes": nbytes, "tensors": n, "device": torch.cuda.get_device_name(dev)}
    for name, fn in runs.items():
        seconds = best_seconds(fn)
        out[name] = {"seconds": round(seconds, 6), "gbps": round(nbytes / seconds / 1e9, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
