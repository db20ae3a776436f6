"""Updates that do not finish leave nothing behind for the next one: a push an engine refused
before reading it, a push its caller cancelled, and a second push started while one is in flight.
Each case checks the engine's real weights, not only its version."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from module_engine import ModuleEngine, make_model
from rollout_engines import EngineConfig, create_engine
from rollout_engines.errors import EngineAsleep, ManifestMismatch, WeightSyncError
from rollout_engines.weights.manifest import specs_of
from rollout_engines.weights.session import connect_weight_sync
from wsync_helpers import tiny_state


def _engine() -> ModuleEngine:
    return ModuleEngine(EngineConfig(backend="module", model="bigram"))


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return dict(make_model(seed).state_dict())


def _holds(engine: ModuleEngine, weights: dict[str, torch.Tensor]) -> bool:
    now = engine.net.state_dict()
    return all(torch.equal(now[k], v) for k, v in weights.items())


async def test_a_refused_push_leaves_no_bucket_for_the_next_push(tiny_model):
    # The engine refuses v1 (asleep) before reading it; v1's buckets are already queued for it.
    engine = create_engine("transformers", model=str(tiny_model), dtype="float32")
    sync = await connect_weight_sync([engine], "inproc", timeout_s=10)
    v1, v2 = tiny_state(str(tiny_model), noise=1.0, seed=1), tiny_state(str(tiny_model), noise=1.0, seed=2)
    await engine.sleep(level=1, tags=["weights"])
    with pytest.raises(WeightSyncError) as info:
        await sync.push(v1, version=1)
    assert isinstance(info.value.__cause__, EngineAsleep)
    await engine.wake_up()
    await sync.push(v2, version=2)
    assert engine.weight_version == 2
    now = engine.hf_model.state_dict()
    layers = [k for k in v2 if ".layers." in k]  # (the embedding and the head are tied: one of them lands)
    assert layers and all(torch.equal(now[k], v2[k]) for k in layers), "the engine took the refused update's buckets"
    await sync.close()
    await engine.close()


async def _cancel_midway(sync, weights: dict[str, torch.Tensor], version: int) -> None:
    def slowly():  # a trainer gathering shards one by one: the caller gives up while it streams
        for item in weights.items():
            time.sleep(0.3)
            yield item

    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sync.push(slowly(), version=version, specs=specs_of(list(weights.items()))), 0.5)


async def test_a_cancelled_push_is_not_applied_and_the_next_one_lands_exactly():
    engine = _engine()
    sync = await connect_weight_sync([engine], "inproc", bucket_bytes=4096, timeout_s=10)
    before = {k: v.clone() for k, v in engine.net.state_dict().items()}
    await _cancel_midway(sync, _weights(1), version=1)
    await asyncio.sleep(1.0)  # nothing of v1 may still be running and land later
    assert engine.weight_version == 0
    assert _holds(engine, before)
    v2 = _weights(2)
    await sync.push(v2, version=2)
    assert engine.weight_version == 2 and _holds(engine, v2)
    await sync.close()
    await engine.close()


async def test_a_second_push_while_one_is_in_flight_is_refused():
    engine = _engine()
    sync = await connect_weight_sync([engine], "inproc", bucket_bytes=4096, timeout_s=10)
    v1 = _weights(1)

    def slowly():
        for item in v1.items():
            time.sleep(0.05)
            yield item

    first = asyncio.ensure_future(sync.push(slowly(), version=1, specs=specs_of(list(v1.items()))))
    await asyncio.sleep(0.05)
    with pytest.raises(WeightSyncError, match="already in flight"):
        await sync.push(_weights(2), version=2)
    assert await first == 1
    assert _holds(engine, v1)
    await sync.close()
    await engine.close()


async def test_an_incomplete_push_is_refused_after_the_same_tensors_went_as_partial():
    # The receiver keeps the last validated layout; whether the update may be partial is part of it.
    engine = _engine()
    sync = await connect_weight_sync([engine], "inproc", bucket_bytes=4096, timeout_s=10)
    subset = {k: v for k, v in _weights(1).items() if k != "head.weight"}
    await sync.push(subset, version=1, partial=True)
    with pytest.raises(ManifestMismatch, match="missing"):
        await sync.push(subset, version=2)
    assert engine.weight_version == 1
    await sync.close()
    await engine.close()


@pytest.mark.parametrize("fault", ["stray", "twice"])
async def test_a_lazy_push_whose_iterator_strays_from_its_specs_fails_and_changes_nothing(fault):
    # specs= promise every tensor the iterator yields, once and in order; a tensor they do not name
    # (or one given twice) would otherwise be held and dropped without a word.
    engine = _engine()
    sync = await connect_weight_sync([engine], "inproc", bucket_bytes=4096, timeout_s=10)
    before = {k: v.clone() for k, v in engine.net.state_dict().items()}
    v1 = _weights(1)
    items = list(v1.items())
    extra = ("extra.weight", torch.zeros(3)) if fault == "stray" else items[0]
    with pytest.raises(WeightSyncError, match="which the specs do not name" if fault == "stray" else "twice"):
        await sync.push(iter([items[0], extra, *items[1:]]), version=1, specs=specs_of(items))
    assert engine.weight_version == 0 and _holds(engine, before)
    await sync.push(v1, version=2)
    assert _holds(engine, v1)
    await sync.close()
    await engine.close()


async def test_a_failed_connect_leaves_no_engine_joined():
    # One engine cannot join (closed); the one that did must not keep a receiver for a dead session.
    joined, closed = _engine(), _engine()
    await closed.close()
    with pytest.raises(WeightSyncError):
        await connect_weight_sync([joined, closed], "shm", timeout_s=10)
    assert joined.receiver.transport is None
    await joined.close()
