"""A mixture-of-experts model in real vLLM on the CPU: weight updates are refused up front.

vLLM's CPU ``reload_weights`` (the only way to load weights into a running CPU engine) repacks a
Qwen3-MoE model's experts so that it answers differently even when handed the very weights it
started with; vLLM's own reload from the checkpoint does the same. A push there would silently
leave a different model, so joining a weight sync fails with :class:`CapabilityError`, and the
engine keeps serving its weights untouched.
"""

from __future__ import annotations

import asyncio

import pytest
from rollout_engines import GenerateRequest, SamplingParams, create_engine
from rollout_engines.errors import CapabilityError, RolloutEnginesError
from rollout_engines.testing.shapes import build_shape
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_weight_sync_into_a_cpu_moe_engine_is_refused_and_the_engine_keeps_serving(tmp_path):
    path = build_shape("tiny-moe", tmp_path / "moe", dtype="float32")
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    expected = hf.generate(torch.tensor([[11, 12, 13, 14]]), max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    request = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=SamplingParams(temperature=0, max_tokens=6))

    async def run() -> tuple[BaseException, list[int]]:
        engine = create_engine("vllm", model=str(path), dtype="float32")
        try:
            assert (await engine.generate(request))[0].token_ids == expected  # vLLM serves the MoE model
            with pytest.raises(RolloutEnginesError) as info:
                await connect_weight_sync([engine], "shm", timeout_s=60)
            return info.value, (await engine.generate(request))[0].token_ids
        finally:
            await engine.close()

    error, after = asyncio.run(run())
    chain, cause = [], error
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    assert any(isinstance(c, CapabilityError) for c in chain), chain
    assert "mixture-of-experts" in str(error) and "GPU" in str(error)
    assert after == expected
