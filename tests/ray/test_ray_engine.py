"""One engine in a Ray actor on a real local Ray cluster (CPU): the same contract as in-process.

A start-up failure reaches the caller as its own type (as :class:`ProcessEngine`'s does) and leaves
no actor behind; a far engine that stops answering ends the call with :class:`EngineUnavailable`
after ``call_timeout_s``. The far engine is :class:`recording_engine.RecordingEngine` (a small real
engine; ``step_s`` is its pause between streamed tokens).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rollout_engines import EngineConfig, GenerateRequest, SamplingParams  # noqa: E402
from rollout_engines.errors import EngineUnavailable, UnknownBackend  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

FACTORY = "recording_engine:RecordingEngine"
TESTS_DIR = str(Path(__file__).resolve().parents[1])  # where recording_engine.py is
REQUEST = GenerateRequest(prompt_token_ids=[[5, 7]], sampling=SamplingParams(temperature=0.0, max_tokens=3))


@pytest.fixture(scope="module")
def ray_cluster():
    # The actor imports the recording engine from tests/.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])}})
    yield
    ray.shutdown()


async def all_cpus_free(timeout_s: float = 30.0) -> bool:
    """Every CPU of the cluster free again (no actor left holding one)."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


@pytest.mark.parametrize(("backend", "factory", "error"), [
    ("recording", "recording_engine:NoSuchEngine", AttributeError),  # Ray would say ActorDiedError
    ("no-such-backend", None, UnknownBackend),  # Ray cannot even unpickle this one
])
async def test_start_up_failure_is_reported_with_its_type(ray_cluster, backend, factory, error):
    from rollout_engines.ray import acreate_ray_engines

    with pytest.raises(error):
        await acreate_ray_engines(1, EngineConfig(backend=backend, model="x"), factory=factory, num_cpus=1,
                                  max_restarts=2, start_timeout_s=120)
    assert await all_cpus_free()  # the failed actor was not left (or restarted) holding its CPU


async def test_a_far_engine_that_stops_answering_ends_the_call_after_call_timeout_s(ray_cluster):
    from rollout_engines.ray import acreate_ray_engines

    config = EngineConfig(backend="recording", model="recording", options={"step_s": 120})  # a stalled engine
    [engine] = await acreate_ray_engines(1, config, factory=FACTORY, num_cpus=1, call_timeout_s=2,
                                         start_timeout_s=120)
    try:
        assert engine.call_timeout_s == 2
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match="did not answer"):
            async for _ in engine.stream(REQUEST):
                pass
        assert time.monotonic() - started < 60  # bounded, not the engine's 120 s per token
        assert len(await engine.generate(REQUEST)) == 1  # the engine itself is still there
    finally:
        await engine.close()
    assert await all_cpus_free()


def test_settings_beside_a_config_are_refused_not_dropped() -> None:
    from rollout_engines.ray.engine import acreate_ray_engines

    config = EngineConfig(backend="recording", model="rec")
    with pytest.raises(TypeError, match="dtype"):
        asyncio.run(acreate_ray_engines(1, config, dtype="float32"))  # refused before any actor starts
