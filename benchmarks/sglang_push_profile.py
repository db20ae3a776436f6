"""Where a relayed SGLang push's time goes, on a CUDA GPU with SGLang installed.

    python benchmarks/sglang_push_profile.py --model DIR [--pushes 10] [--json]

Starts an SGLang engine on ``DIR`` (bfloat16, Triton attention, no CUDA graphs), loads the
checkpoint onto the GPU as the trainer's tensors and pushes them as one bucket the way the
engine's relay does, timing each step: ``stage`` (copy into the relay's staging buffer,
:class:`rollout_engines_sglang.payloads.Stager`), ``serialize`` (one payload per TP rank) and
``call`` (SGLang's ``update_weights_from_tensor``). With the timing loaders of
``sglang_probe_loader.py`` the call is split further, from inside SGLang's scheduler:
``to_loader`` (tokenizer manager, scheduler queue, unpickling, CUDA IPC import), ``views``,
``load_weights``, ``sync`` and ``from_loader`` (the answer's way back). Variants:
``flattened_bucket`` (SGLang's own loading), ``probe`` (the timing loader), ``probe_keep`` (it
keeps the import alive between pushes). Medians of pushes 2..N, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--pushes", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parent)
    # SGLang's schedulers are spawned: they find the timing loaders through PYTHONPATH.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    log = Path(tempfile.mkdtemp()) / "probe.jsonl"
    os.environ["SGLANG_PROBE_LOG"] = str(log)

    import torch
    from rollout_engines import create_engine
    from rollout_engines.weights.checkpoint import load_checkpoint
    from rollout_engines_sglang.payloads import Stager, loader_payloads, serialize_per_rank

    engine: Any = create_engine(
        "sglang", model=args.model, dtype="bfloat16", attention_backend="triton", sampling_backend="pytorch",
        disable_cuda_graph=True, mem_fraction_static=0.4, copy_plan=False,
        custom_weight_loader=["sglang_probe_loader.load", "sglang_probe_loader.load_keep"],
    )
    rt, device = engine.runtime, torch.device("cuda:0")
    named = [(k, v.to(device)) for k, v in load_checkpoint(args.model, dtype=torch.bfloat16).items()]

    async def variant(load_format: str) -> dict[str, float]:
        log.unlink(missing_ok=True)
        stager, rows = Stager(device), []
        build = serialize_per_rank if load_format == "flattened_bucket" else loader_payloads
        for _ in range(args.pushes):
            torch.cuda.synchronize()
            t0 = time.time()
            flat, metadata, _ = stager.stage(named)
            t1 = time.time()
            payloads = build(flat, metadata, rt.tp_size, rt.serialize)
            t2 = time.time()
            await rt.update_from_tensor(payloads, load_format)
            t3 = time.time()
            rows.append({"stage": t1 - t0, "serialize": t2 - t1, "call": t3 - t2, "total": t3 - t0, "sent": t2,
                         "back": t3})
        if log.exists():
            for row, line in zip(rows, log.read_text().splitlines(), strict=True):
                inside = json.loads(line)
                row.update(to_loader=inside["enter"] - row["sent"], views=inside["views"],
                           load_weights=inside["load_weights"], sync=inside["sync"],
                           from_loader=row["back"] - inside["exit"])
        keys = [k for k in rows[0] if k not in ("sent", "back")]
        return {k: round(statistics.median(r[k] for r in rows[1:]) * 1e3, 3) for k in keys}

    async def run() -> dict[str, Any]:
        return {
            "flattened_bucket": await variant("flattened_bucket"),
            "probe": await variant("sglang_probe_loader.load"),
            "probe_keep": await variant("sglang_probe_loader.load_keep"),
        }

    try:
        out = {"model": args.model, "tensors": len(named), "unit": "ms, median of pushes 2..N", **asyncio.run(run())}
    finally:
        asyncio.run(engine.close())
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
