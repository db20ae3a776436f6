"""BF16 pushes into a BF16 engine vs into an FP8 block engine (issue 19, item 3), in one run; any backend
with the option ``weight_quantization`` (vLLM, SGLang: ``--backend sglang``).

    python benchmarks/fp8_push.py --model DIR --option gpu_memory_utilization=0.4 \\
        --option weight_apply_mode=inplace --checksum none --json

Three timings of the same weights from trainer tensors on the GPU (``cuda_ipc`` by default):

- ``bf16``: BF16 tensors into an engine serving the BF16 checkpoint (the baseline);
- ``fp8_receiver``: the same BF16 tensors into an engine serving the FP8 block copy
  (``weight_quantization="fp8_block"``), quantized by the engine (vLLM: in its workers while
  loading; SGLang: by its relay before SGLang loads them);
- ``fp8_sender``: into the FP8 engine, quantized by the trainer before sending
  (``push(quantize="fp8_block")``, on the trainer's GPU; the quantization is inside the timing).

Each mode pushes perturbed and original weights alternately; ``push_s`` is the median of pushes
2..N. Each is checked with the engine's weights fingerprint: the perturbed push changes it, the
final push of the originals brings it back to the engine's start-up fingerprint (for ``fp8_sender``
exactly: the trainer quantizes as the FP8 copy was built; for ``fp8_receiver`` up to the worker's
Triton quantizer's rounding, so that one reports whether it came back exactly). ``ratio_*`` = FP8
push / BF16 push; the target is ``<= 2``. The engines run one at a time; the trainer's two weight sets stay on the GPU throughout
(a 14B shape: 2 x 28 GB, so use ``weight_apply_mode=inplace``: staged updates copy the push once more).

On a vLLM without DeepGEMM's JIT headers (a stripped install), run with ``VLLM_USE_DEEP_GEMM=0``:
vLLM otherwise picks DeepGEMM for block FP8 on Hopper and its engine fails to start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch
from rollout_engines.bench.common import (
    Fingerprint,
    add_push_arguments,
    parse_options,
    push_weights,
    split_transport_options,
)
from rollout_engines.bench.push import _phases
from rollout_engines.factory import create_engine
from rollout_engines.types import GenerateRequest, SamplingParams
from rollout_engines.weights.fp8 import fp8_block_checkpoint_cached
from rollout_engines.weights.session import connect_weight_sync

PROBE = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=SamplingParams(temperature=0, max_tokens=8))


async def _pushes(engine: Any, weights: Any, transport: str, args: Any, quantize: str | None,
                  transport_options: dict[str, Any], start: Any) -> dict[str, Any]:
    """Pushes into ``engine``; ``start`` is its fingerprint as it came up (the checkpoint's weights),
    taken before any mode pushed, so each mode's final push of the originals is compared with the
    checkpoint and not with what the previous mode left."""
    fingerprint = Fingerprint(engine, PROBE)
    sync = await connect_weight_sync([engine], transport, bucket_bytes=int(args.bucket_mb * 2**20), timeout_s=600,
                                     checksum=args.checksum, options=transport_options)
    times: list[float] = []
    phases: list[dict[str, float]] = []
    try:
        for i in range(args.pushes):
            tensors = weights.changed if i % 2 == 0 else weights.original
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            await sync.push(tensors, version=engine.weight_version + 1, quantize=quantize)
            times.append(time.perf_counter() - t0)
            phases.append(_phases(await engine.diagnostics(), times[-1]))
            if i == 0:
                differs = await fingerprint() != start
        await sync.push(weights.original, version=engine.weight_version + 1, quantize=quantize)
        restored = await fingerprint() == start
    finally:
        await sync.close()
    later = times[1:] or times
    return {
        "first_push_s": round(times[0], 4),
        "push_s": round(statistics.median(later), 4),
        "best_push_s": round(min(later), 4),
        "perturbed_push_changed_weights": differs,
        "original_push_restored_weights_exactly": restored,
        "phases_median_s": {k: round(statistics.median(p[k] for p in phases[1:] or phases), 6) for k in phases[0]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_push_arguments(parser, checksum="pos64")
    parser.add_argument("--pushes", type=int, default=6)
    parser.add_argument("--modes", default="bf16,fp8_receiver,fp8_sender")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    if args.model is None:
        parser.error("--model DIR is required (a BF16 safetensors checkpoint whose projections fill 128-row blocks)")
    modes = args.modes.split(",")
    options, transport_options = split_transport_options(parse_options(args))
    options.pop("weight_quantization", None)

    t0 = time.perf_counter()
    fp8_dir = fp8_block_checkpoint_cached(args.model, device="cuda")
    out: dict[str, Any] = {"model": args.model, "fp8_copy": fp8_dir.name,  # its name under $ROLLOUT_ENGINES_CACHE/fp8-block
                           "fp8_copy_find_or_build_s": round(time.perf_counter() - t0, 2), "options": options}
    weights: Any = None
    for kind, wanted in (("none", ["bf16"]), ("fp8_block", ["fp8_receiver", "fp8_sender"])):
        todo = [m for m in wanted if m in modes]
        if not todo:
            continue
        engine = create_engine(args.backend, model=args.model, weight_quantization=kind, **options)
        try:
            start = asyncio.run(Fingerprint(engine, PROBE)())
            if weights is None:
                weights = asyncio.run(push_weights(engine, args.model, args.transport))
                out.update(transport=weights.transport, bytes_bf16=weights.total_bytes, tensors=len(weights.original))
            for mode in todo:
                quantize = "fp8_block" if mode == "fp8_sender" else None
                out[mode] = asyncio.run(
                    _pushes(engine, weights, weights.transport, args, quantize, transport_options, start))
        finally:
            asyncio.run(engine.close())
    base = out.get("bf16", {}).get("push_s")
    for mode in ("fp8_receiver", "fp8_sender"):
        if base and mode in out:
            out[f"ratio_{mode}"] = round(out[mode]["push_s"] / base, 3)
    out["target_ratio"] = 2.0
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
