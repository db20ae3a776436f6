"""ProcessEngine: an engine in a child process behaves like one in this process, and says so
clearly when the child dies."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from rollout_engines import EngineConfig
from rollout_engines.errors import EngineUnavailable, WeightSyncError
from rollout_engines.process import ProcessEngine
from rollout_engines.weights.manifest import plan_manifest, specs_of
from rollout_engines.weights.session import connect_weight_sync
from wsync_helpers import PROMPTS, module_engine_process, outputs, state

pytestmark = pytest.mark.timeout(120)


async def test_generate_info_and_typed_errors_cross_the_pipe():
    engine = module_engine_process()
    try:
        assert engine.pid != os.getpid()
        outs = await engine.generate(PROMPTS)
        assert len(outs) == 4 and all(len(c.token_ids) == 6 for c in outs)
        info = await engine.info()
        assert info.backend == "module" and info.capabilities["multi_process"] is True
        manifest = plan_manifest(specs_of(list(state(1).items())), version=1)
        with pytest.raises(WeightSyncError, match="no weight transfer initialised"):
            await engine.receive_weights(manifest)  # raised in the child, same type here
        assert await engine.health()
    finally:
        await engine.close()
        await engine.close()  # idempotent
    assert not await engine.health()


async def test_dead_child_gives_engine_unavailable_not_a_hang():
    engine = module_engine_process()
    try:
        before = await outputs(engine)
        assert before
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailable, match="exited with code -9"):
            await asyncio.wait_for(engine.generate(PROMPTS), 30)
        assert not await engine.health()
    finally:
        await engine.close()


def test_start_up_failure_is_reported_with_its_type():
    with pytest.raises(AttributeError, match="NoSuchEngine"):
        ProcessEngine(EngineConfig(backend="module", model="x"), factory="module_engine:NoSuchEngine")


async def test_a_push_resets_the_hosted_engines_cache_once():
    # The child's engine applies the core's rule (reset after every update); the proxy must not
    # send a second reset over the pipe.
    engine = module_engine_process()
    try:
        sync = await connect_weight_sync([engine], "shm", timeout_s=30)
        before = await outputs(engine)
        await sync.push(state(1), version=1)
        await sync.push(state(2), version=2)
        assert (await engine.info()).extra["cache_resets"] == 2
        assert await outputs(engine) != before
        await engine.reset_prefix_cache()  # an explicit reset still crosses the pipe
        assert (await engine.info()).extra["cache_resets"] == 3
        await sync.close()
    finally:
        await engine.close()
