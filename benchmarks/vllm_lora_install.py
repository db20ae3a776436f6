"""Where a vLLM worker's LoRA install goes (issue 19): vLLM's own activation against the plugin's.

    python benchmarks/vllm_lora_install.py --model DIR --json

One vLLM engine in this process (``LLM`` with the in-process engine core and executor), its worker
reached directly. A rank-16 adapter of the model's q/v projections (``make_lora``) is installed
into the worker as a push installs it (``rollout_engines_vllm.lora.worker_install_lora``), each
install removing the version two before it, as the engine retires versions. Three phases, 30
timed installs each after 5 warm-up ones, medians with the device synchronised after each:

- ``vllm``: vLLM's activation as it is (the plugin's leading empty layer switched off, LoRA
  layers not prepared);
- ``probe``: with the leading empty layer (no ``str()`` of a device tensor per build);
- ``probe_clean_slots``: and the LoRA layers prepared by ``worker_lora_setup`` (slots known to be
  zero are not zeroed again).

``--profile`` prints cProfile's top functions of 20 more installs on stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import json
import os
import pstats
import statistics
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--installs", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core, and so the worker, in this process
    import torch
    from rollout_engines.weights.lora import make_lora, write_adapter_config
    from rollout_engines_vllm import lora
    from safetensors.torch import load_file
    from vllm import LLM

    cuda = torch.cuda.is_available()
    llm = LLM(model=args.model, enable_lora=True, max_lora_rank=args.rank, max_loras=1, max_cpu_loras=2,
              enforce_eager=True, distributed_executor_backend="uni", gpu_memory_utilization=0.3, max_model_len=512)
    engine = llm.llm_engine
    executor = getattr(engine, "model_executor", None) or engine.engine_core.engine_core.model_executor
    worker = executor.driver_worker.worker
    weights: dict = {}
    for file in glob.glob(os.path.join(args.model, "*.safetensors")):
        weights.update(load_file(file))
    spec, tensors = make_lora(weights, "bench", rank=args.rank, seed=1)
    tensors = {n: t.to("cuda" if cuda else "cpu") for n, t in tensors.items()}
    folder = tempfile.mkdtemp(prefix="roe-lora-bench-")
    write_adapter_config(folder, spec, base_model=args.model)
    if not cuda:
        lora.fix_cpu_no_lora_rows()
    count = 0

    def install() -> None:
        nonlocal count
        count += 1
        if count > 2:
            lora.worker_remove_loras(worker, [count - 2])
        lora.worker_install_lora(worker, dict(tensors), key=f"bench-{count}", lora_id=count, path=folder)
        if cuda:
            torch.cuda.synchronize()

    def phase() -> dict[str, float]:
        for _ in range(5):
            install()
        times = []
        for _ in range(args.installs):
            t0 = time.perf_counter()
            install()
            times.append(time.perf_counter() - t0)
        return {"median_ms": round(statistics.median(times) * 1e3, 3), "best_ms": round(min(times) * 1e3, 3)}

    device_first = lora._device_first
    lora._device_first = lambda model, device: model  # type: ignore[assignment]
    result: dict = {"model": args.model, "rank": args.rank, "tensors": len(tensors), "device": "cuda" if cuda else "cpu",
                    "installs": args.installs, "vllm": phase()}
    lora._device_first = device_first  # type: ignore[assignment]
    result["probe"] = phase()
    lora.worker_lora_setup(worker)
    result["probe_clean_slots"] = phase()
    result["ratio"] = round(result["probe_clean_slots"]["median_ms"] / result["vllm"]["median_ms"], 3)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(20):
            install()
        profile.disable()
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
