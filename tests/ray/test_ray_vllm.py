"""vLLM engines as Ray actors on a real local Ray cluster (CPU): a group of two, one gloo push
reaches both engines' workers, and the group routes to both afterwards."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest

ray = pytest.importorskip("ray")

from rollout_engines import EngineGroup, GenerateRequest, SamplingParams, connect_weight_sync  # noqa: E402
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.timeout(900)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CACHE_ROOT": os.path.join(tempfile.gettempdir(), "roe-vllm-cache"),
                                       "HF_HUB_OFFLINE": "1"}})
    yield
    ray.shutdown()


async def test_vllm_engines_as_ray_actors_take_one_gloo_push(ray_cluster, tiny_model):
    from rollout_engines.ray import acreate_ray_engines

    engines = await acreate_ray_engines(2, "vllm", model=str(tiny_model), dtype="float32", num_cpus=1)
    try:
        group = EngineGroup(engines, routing="round_robin", health_interval_s=None)
        request = GenerateRequest(prompts=["The quick brown fox", "def add(a, b):"], sampling=GREEDY)
        before = [[c.token_ids for c in await e.generate(request)] for e in engines]
        assert before[0] == before[1]

        sync = await connect_weight_sync([group], "gloo", timeout_s=120)
        try:
            await sync.push(perturbed(load_checkpoint(tiny_model), seed=13), version=2)
        finally:
            await sync.close()

        after = [[c.token_ids for c in await e.generate(request)] for e in engines]
        assert after[0] == after[1] != before[0]  # both actors changed, to the same weights
        routed = [await group.generate(request) for _ in range(2)]
        assert all([c.token_ids for c in r] == after[0] and r[0].weight_version == 2 for r in routed)
        await group.detach()
    finally:
        await asyncio.gather(*(e.close() for e in engines))
