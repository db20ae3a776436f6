"""Cross-engine agreement: vLLM and the embedded transformers engine, same tiny model in float32,
greedy sampling, give the same tokens, before and after the same weight push.

Both engines receive the update in one gloo session from this process (the trainer), so the
push is literally the same bytes. Long prompts make vLLM serve the second round from its prefix
cache if it were stale, so agreement after the push also proves the cache was reset.
"""

from __future__ import annotations

import asyncio

import pytest
from rollout_engines import GenerateRequest, SamplingParams, create_engine
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.vllm, pytest.mark.transformers, pytest.mark.timeout(600)]

TEXTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time there was a",
    "import numpy as np\nimport torch\n\nclass Engine:\n    def __init__(self, model):\n        self.model = model",
]


@pytest.fixture(scope="module")
def engines(tiny_model):
    vllm_engine = create_engine("vllm", model=str(tiny_model), dtype="float32")
    hf_engine = create_engine("transformers", model=str(tiny_model), dtype="float32", device="cpu")
    yield vllm_engine, hf_engine

    async def close() -> None:
        await vllm_engine.close()
        await hf_engine.close()

    asyncio.run(close())


@pytest.fixture(scope="module")
def request_(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = [list(tok(t)["input_ids"]) for t in TEXTS]
    ids.append([(i * 53) % 4000 + 10 for i in range(200)])  # long: spans many prefix-cache blocks
    return GenerateRequest(prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))


async def both(engines, request):
    vllm_out, hf_out = await asyncio.gather(*(e.generate(request) for e in engines))
    return [c.token_ids for c in vllm_out], [c.token_ids for c in hf_out], vllm_out, hf_out


async def test_logprobs_agree(engines, request_):
    """Runs first, on the checkpoint's weights."""
    req = request_.model_copy(update={"sampling": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)})
    vllm_out, hf_out = await asyncio.gather(*(e.generate(req) for e in engines))
    for a, b in zip(vllm_out, hf_out, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)


async def test_same_tokens_before_and_after_the_same_push(engines, request_, tiny_model):
    vllm_tokens, hf_tokens, _, _ = await both(engines, request_)
    assert vllm_tokens == hf_tokens

    original = load_checkpoint(tiny_model)
    sync = await connect_weight_sync(list(engines), "gloo", timeout_s=60)
    try:
        await sync.push(perturbed(original), version=1)
        new_vllm, new_hf, vllm_out, hf_out = await both(engines, request_)
        assert new_vllm != vllm_tokens, "the push must change outputs"
        assert new_vllm == new_hf, "both engines must serve exactly the pushed weights"
        assert all(c.weight_version == 1 for c in vllm_out + hf_out)

        await sync.push(original, version=2)
        back_vllm, back_hf, _, _ = await both(engines, request_)
        assert back_vllm == back_hf == vllm_tokens
    finally:
        await sync.close()
