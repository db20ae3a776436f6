"""The trainer's per-push Python work of planning a steady push, and the interpreter's full
collections it sets off, for a model with many tensors (a MoE's).

    python benchmarks/layout_check.py [--tensors 9435] [--pushes 60]

Each push runs what ``WeightSync.push`` runs on the trainer before any byte moves (the layout
check against the last push, the manifest of the new version) and then takes the tensors one by
one as the sender does. Prints one JSON line: the median and largest planning time, and the
full (oldest-generation) collections started during the pushes with their total pause. Tensors
are tiny CPU tensors: only their number matters here.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from rollout_engines.weights.session import WeightSync


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=9435)
    parser.add_argument("--pushes", type=int, default=60)
    args = parser.parse_args()
    state = {f"model.layers.{i // 384}.mlp.experts.{i % 384}.w": torch.empty(4, 4, dtype=torch.bfloat16)
             for i in range(args.tensors)}
    sync = WeightSync([], None, transport="cuda_ipc", bucket_bytes=1 << 31,  # type: ignore[arg-type]
                      timeout_s=60, checksum="none", progress=False)
    full: list[float] = []
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started.append(time.perf_counter())
        else:
            full.append(time.perf_counter() - started.pop())

    sync._manifest(state.items(), None, 1)  # the first push plans the layout
    gc.collect()
    gc.callbacks.append(callback)
    times = []
    for version in range(2, args.pushes + 2):
        start = time.perf_counter()
        _, items = sync._manifest(state.items(), None, version)
        pending = {}
        for name, tensor in iter(items):
            pending[name] = tensor
        times.append(time.perf_counter() - start)
    gc.callbacks.remove(callback)
    print(json.dumps({
        "tensors": args.tensors, "pushes": args.pushes,
        "plan_ms_median": round(statistics.median(times) * 1e3, 2), "plan_ms_max": round(max(times) * 1e3, 2),
        "full_collections": len(full), "full_collection_ms_total": round(sum(full) * 1e3, 1),
    }))


if __name__ == "__main__":
    main()
