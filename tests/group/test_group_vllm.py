"""A group of two real vLLM engines: requests spread over both, one gloo session reaches every
worker of both engines (each engine's worker runs in vLLM's own process)."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest
from rollout_engines import EngineGroup, create_engine

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


async def test_vllm_group_routes_and_one_push_reaches_both_engines(engines, one_push_reaches_both):
    group = EngineGroup(engines, routing="round_robin", health_interval_s=None)
    assert group.weight_receivers() == sum(e.weight_receivers() for e in engines)
    await one_push_reaches_both(group, engines, seed=11, version=3, routed=4)
    assert [s["completed"] for s in group.member_stats()] == [2, 2]
