"""vLLM engines as Ray actors on a real local Ray cluster (CPU): a group of two, one gloo push
reaches both engines' workers, and the group routes to both afterwards."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest

ray = pytest.importorskip("ray")

from rollout_engines import EngineGroup  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CACHE_ROOT": os.path.join(tempfile.gettempdir(), "roe-vllm-cache"),
                                       "HF_HUB_OFFLINE": "1"}})
    yield
    ray.shutdown()


async def test_vllm_engines_as_ray_actors_take_one_gloo_push(ray_cluster, tiny_model, one_push_reaches_both):
    from rollout_engines.ray import acreate_ray_engines

    engines = await acreate_ray_engines(2, "vllm", model=str(tiny_model), dtype="float32", num_cpus=1)
    try:
        group = EngineGroup(engines, routing="round_robin", health_interval_s=None)
        await one_push_reaches_both(group, engines, seed=13, version=2, routed=2)
        await group.detach()
    finally:
        await asyncio.gather(*(e.close() for e in engines))
