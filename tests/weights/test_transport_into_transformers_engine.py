"""The embedded transformers engine, in its own process, receives over every CPU transport."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams
from rollout_engines.errors import ManifestMismatch, WeightSyncError
from rollout_engines.process import ProcessEngine
from rollout_engines.testing.trainer import trainer_killed_mid_stream
from rollout_engines.weights.session import connect_weight_sync
from wsync_helpers import tiny_state, tiny_trainer_main

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(300)]
GREEDY = GenerateRequest(prompt_token_ids=[[5, 6, 7], [100, 200]], sampling=SamplingParams(temperature=0, max_tokens=8))
BUCKET = 2**18  # the tiny model (~3 MB) goes in many buckets


@pytest.fixture(scope="module")
def tiny_path(tiny_model):
    return str(tiny_model)


@pytest.fixture(scope="module")
def engine(tiny_path):
    # Synchronous fixture: the proxy is loop-agnostic, so one engine process serves every test.
    eng = ProcessEngine(EngineConfig(backend="transformers", model=tiny_path, dtype="float32"))
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def states(tiny_path):
    return {"orig": tiny_state(tiny_path), "new": tiny_state(tiny_path, noise=1.0)}


async def greedy(engine) -> list[list[int]]:
    return [c.token_ids for c in await engine.generate(GREEDY)]


@pytest.mark.parametrize("transport", ["gloo", "shm", "disk"])
async def test_push_changes_greedy_output_and_restore_restores_it(engine, states, transport):
    before = await greedy(engine)
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=60)
    v = engine.weight_version  # versions only go up: the engine is shared by every test here
    try:
        await sync.push(states["new"], version=v + 1)
        changed = await engine.generate(GREEDY)
        assert [c.token_ids for c in changed] != before
        assert {c.weight_version for c in changed} == {v + 1}
        await sync.push(states["orig"], version=v + 2)
        assert await greedy(engine) == before
    finally:
        await sync.close()


async def test_bad_manifest_keeps_outputs_and_next_push_works(engine, states):
    before = await greedy(engine)
    sync = await connect_weight_sync([engine], "gloo", bucket_bytes=BUCKET, timeout_s=60)
    v = engine.weight_version
    try:
        bad = dict(states["new"])
        name = next(iter(bad))
        bad[name] = bad[name].to(torch.float16)
        with pytest.raises(WeightSyncError) as info:
            await sync.push(bad, version=v + 1)
        assert isinstance(info.value.failures[0][1], ManifestMismatch)
        assert f"'{name}': dtype float16" in str(info.value)
        assert await greedy(engine) == before
        await sync.push(states["new"], version=v + 1)
        assert await greedy(engine) != before
        await sync.push(states["orig"], version=v + 2)
    finally:
        await sync.close()


@pytest.mark.parametrize("transport", ["gloo", "shm"])
async def test_trainer_killed_mid_stream_keeps_previous_weights(engine, states, tiny_path, transport):
    before = await greedy(engine)
    version = (await engine.info()).weight_version
    async with trainer_killed_mid_stream(engine, tiny_trainer_main, (transport, 2, 60.0, tiny_path, 10),
                                         transport=transport, session_id="killed-tiny-trainer", tensors=states["new"],
                                         version=version + 1, bucket_bytes=BUCKET, timeout_s=60) as (receiving, _):
        with pytest.raises(WeightSyncError) as info:
            await asyncio.wait_for(receiving, 60)
        assert "peer: trainer (rank 0)" in str(info.value) and "bucket: " in str(info.value)
    assert await greedy(engine) == before
    assert (await engine.info()).weight_version == version
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=60)
    await sync.push(states["new"], version=version + 1)
    assert await greedy(engine) != before
    await sync.push(states["orig"], version=version + 2)
    assert await greedy(engine) == before
    await sync.close()
