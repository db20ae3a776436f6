"""Building the views of one bucket's tensors in a flat buffer: the library's way
(``rollout_engines.weights.buckets.bucket_views``: one ``as_strided`` a tensor on a view of the
buffer as its dtype) against the plain one (a slice, a dtype view and a shape view a tensor).

    python benchmarks/bucket_views.py [--tensors 18867] [--repeats 7]

Every receiver of a fresh buffer builds these views each push (``gloo``, ``nccl``, ``disk``,
staged updates), and so does the trainer packing into buffers of its own. Tensors of three dtypes
and a few shapes, laid out by the library's planner in one bucket of a CPU buffer. Checks that
both ways give the same views (address, shape, strides, dtype). Prints one JSON line: the best
time of each way, per bucket and per tensor.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from rollout_engines.weights.buckets import bucket_views, torch_dtype
from rollout_engines.weights.manifest import TensorSpec, plan_manifest


def plain(buf: torch.Tensor, placements: list) -> list[tuple[str, torch.Tensor]]:
    return [(p.name, buf[p.offset : p.offset + p.nbytes].view(torch_dtype(p.dtype)).view(p.shape)) for p in placements]


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=18867)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    dtypes = ("bfloat16", "float32", "int8")
    specs = [TensorSpec(name=f"t{i}", dtype=dtypes[i % 3], shape=(4, i % 7 + 1, 33)) for i in range(args.tensors)]
    manifest = plan_manifest(specs, version=1, bucket_bytes=1 << 40, transport="gloo")
    placements = manifest.bucket_tensors(0)
    buf = torch.empty(manifest.buckets[0].nbytes, dtype=torch.uint8)
    fast, slow = bucket_views(buf, placements), plain(buf, placements)
    same = all(
        a[0] == b[0] and (a[1].data_ptr(), a[1].shape, a[1].stride(), a[1].dtype)
        == (b[1].data_ptr(), b[1].shape, b[1].stride(), b[1].dtype)
        for a, b in zip(fast, slow, strict=True)
    )
    t_fast = best_of(lambda: bucket_views(buf, placements), args.repeats)
    t_plain = best_of(lambda: plain(buf, placements), args.repeats)
    result = {
        "tensors": args.tensors, "same_views": same,
        "bucket_views_ms": round(t_fast * 1e3, 2), "plain_ms": round(t_plain * 1e3, 2),
        "bucket_views_us_per_tensor": round(t_fast / args.tensors * 1e6, 2),
        "plain_us_per_tensor": round(t_plain / args.tensors * 1e6, 2),
        "ratio": round(t_plain / t_fast, 2),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
