"""The receiver's Python work per push, apart from the copies: one JSON line.

    python benchmarks/loader_overhead.py [--shape qwen3-30b-a3b] [--bucket-mb 2048]

An engine's copy-plan loader (:class:`rollout_engines.weights.copy_plan.PlannedLoader`, what the
vLLM and SGLang workers apply pushes with on a GPU) walks each bucket's names: is the name planned,
which destination slices, which source views. The GPU copies run behind it, so where a bucket
holds hundreds of tensors (a mixture of experts: 128 experts x 3 projections a layer) that walk
can take as long as the GPU takes to copy the bucket. This measures it on the CPU, for the
tensors of a named shape in the buckets ``bench push --bucket-mb`` makes, with the copies left
out (each tensor is a 16-element stand-in; the work per name does not depend on its size):
``first`` is a bucket's first update after the plan was learned, ``steady`` the same views
coming back (zero-copy ``cuda_ipc``, the SGLang relay's kept buffer), per bucket (median) and per
push (sum).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rollout_engines.testing.shapes import SHAPES, tensor_shapes
from rollout_engines.weights.copy_plan import PlannedLoader
from rollout_engines.weights.manifest import TensorSpec, plan_manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--bucket-mb", type=float, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    shapes = tensor_shapes(SHAPES[args.shape])
    specs = [TensorSpec(name=n, dtype="bfloat16", shape=list(s)) for n, s in shapes]
    manifest = plan_manifest(specs, version=1, bucket_bytes=int(args.bucket_mb * 2**20), transport="cuda_ipc",
                             timeout_s=60, checksum="none")
    params = {n: torch.zeros(16) for n, _ in shapes}
    buckets = [[(p.name, torch.ones(16)) for p in manifest.bucket_tensors(b.index)] for b in manifest.buckets]

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            params[name].copy_(tensor)

    loader = PlannedLoader()
    loader.plan.copier.copy = lambda dsts, srcs: None  # type: ignore[method-assign]  # the copies are not measured
    for named in buckets:
        loader.apply(named, load, owned=True)  # learns the plan
    timings: dict[str, list[list[float]]] = {"first": [], "steady": []}
    for kind in ("first", "steady"):
        for _ in range(args.repeats):
            if kind == "first":
                loader.forget_sources()
            per_bucket = []
            for named in buckets:
                t0 = time.perf_counter()
                loader.apply(named, load, owned=False)
                per_bucket.append(time.perf_counter() - t0)
            timings[kind].append(per_bucket)
    sizes = [len(b) for b in buckets]
    out = {
        "shape": args.shape, "tensors": len(shapes), "buckets": len(buckets), "bucket_mb": args.bucket_mb,
        "tensors_per_bucket_max": max(sizes), "tensors_per_bucket_median": statistics.median(sizes),
    }
    for kind, runs in timings.items():
        best = min(runs, key=sum)
        out[f"{kind}_bucket_us_median"] = round(statistics.median(best) * 1e6, 1)
        out[f"{kind}_push_ms"] = round(sum(best) * 1e3, 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
