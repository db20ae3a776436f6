"""A group of two real vLLM engines: requests spread over both, one gloo session reaches every
worker of both engines (each engine's worker runs in vLLM's own process)."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest
from rollout_engines import EngineGroup, GenerateRequest, SamplingParams, connect_weight_sync, create_engine
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed

os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "roe-vllm-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engines(tiny_model):
    started = []
    try:
        for _ in range(2):
            started.append(create_engine("vllm", model=str(tiny_model), dtype="float32"))
        yield started
    finally:
        for e in started:
            asyncio.run(e.close())


async def test_vllm_group_routes_and_one_push_reaches_both_engines(engines, tiny_model):
    group = EngineGroup(engines, routing="round_robin", health_interval_s=None)
    assert group.weight_receivers() == sum(e.weight_receivers() for e in engines)
    request = GenerateRequest(
        prompts=["The quick brown fox", "def add(a, b):"], sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    before = [[c.token_ids for c in await e.generate(request)] for e in engines]
    assert before[0] == before[1]

    sync = await connect_weight_sync([group], "gloo", timeout_s=120)
    try:
        await sync.push(perturbed(load_checkpoint(tiny_model), seed=11), version=3)
    finally:
        await sync.close()

    after = [[c.token_ids for c in await e.generate(request)] for e in engines]
    assert after[0] == after[1] != before[0]  # both engines changed, to the same weights
    routed = [await group.generate(request) for _ in range(4)]
    assert all([c.token_ids for c in r] == after[0] and r[0].weight_version == 3 for r in routed)
    assert [s["completed"] for s in group.member_stats()] == [2, 2]
