"""Option ``direct_receive``: pushes into an idle vLLM engine start in its workers through the weight-
sync store's doorbell (rollout_engines.weights.doorbell), not through vLLM's ``collective_rpc``.

Real vLLM (its worker in vLLM's engine-core process), real transports; the test process is the
trainer. What must hold: the weights land as by the RPC, a push while a request runs still goes
through the RPC (unless ``pause("keep")`` froze vLLM's scheduler), and a request that arrives while
the workers receive runs only afterwards, on the new weights, labelled with their version.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from rollout_engines import GenerateRequest, SamplingParams, create_engine
from rollout_engines.weights.checkpoint import perturbed
from rollout_engines.weights.manifest import specs_of
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BUCKET = 256 * 1024


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = create_engine("vllm", model=str(tiny_model), dtype="float32", direct_receive=True)
    yield eng
    asyncio.run(eng.close())


def request(max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[[5, 6, 7, 8], [9, 10, 11, 12, 13]],
                           sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def idle(engine):
    """Until the engine holds no request (a stream's last delta can reach its reader just before
    the engine lets go of the request)."""
    deadline = time.monotonic() + 10
    while engine._seqs and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not engine._seqs


async def last_receive(engine):
    return (await engine.diagnostics()).last_receive


@pytest.mark.parametrize("transport", ["shm", "gloo"])
async def test_idle_pushes_ring_the_workers_and_land(engine, original, transport):
    before = await engine.generate(request())
    rings = (await engine.info()).extra["direct_receives"]
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=60)
    try:
        v = engine.weight_version + 1
        await sync.push(perturbed(original), version=v)
        assert (await last_receive(engine)).direct is True
        changed = await engine.generate(request())
        assert [c.token_ids for c in changed] != [c.token_ids for c in before]
        # vLLM itself labels every token with the new version (its label was sent before this request)
        assert all(c.weight_version == v and c.token_weight_versions is None for c in changed)
        await sync.push(original, version=v + 1)
        restored = await engine.generate(request())
        assert [c.token_ids for c in restored] == [c.token_ids for c in before]
        assert all(c.weight_version == v + 1 for c in restored)
    finally:
        await sync.close()
    assert (await engine.info()).extra["direct_receives"] == rings + 2


async def test_a_push_while_a_request_runs_goes_through_the_rpc(engine, original):
    sync = await connect_weight_sync([engine], "shm", bucket_bytes=BUCKET, timeout_s=60)
    v = engine.weight_version + 1
    versions: list[int] = []
    try:
        async for d in engine.stream(request(max_tokens=400)):
            versions += [d.weight_version] * len(d.token_ids)
            if len(versions) >= 3 and engine.weight_version < v:
                await sync.push(perturbed(original), version=v)
                assert (await last_receive(engine)).direct is False
        await idle(engine)
        await sync.push(original, version=v + 1)  # idle again: the doorbell
        assert (await last_receive(engine)).direct is True
    finally:
        await sync.close()
    assert versions[0] == v - 1 and versions[-1] == v and len(versions) == 800


async def test_a_push_inside_a_keep_pause_rings_the_frozen_engine(engine, original):
    """pause("keep") freezes vLLM's scheduler: the running request steps no more, so the workers
    may be rung; after resume it goes on under the new weights (its versions switch once)."""
    sync = await connect_weight_sync([engine], "shm", bucket_bytes=BUCKET, timeout_s=60)
    v = engine.weight_version + 1
    versions: list[int] = []
    try:
        one = GenerateRequest(prompt_token_ids=[[5, 6, 7, 8]],
                              sampling=SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
        async for d in engine.stream(one):
            versions += [d.weight_version] * len(d.token_ids)
            if len(versions) >= 3 and engine.weight_version < v:
                await engine.pause("keep")
                try:
                    await sync.push(perturbed(original), version=v)
                    assert (await last_receive(engine)).direct is True
                finally:
                    await engine.resume()
        await sync.push(original, version=v + 1)
    finally:
        await sync.close()
    switch = versions.index(v)
    assert 3 <= switch < 120 and versions == [v - 1] * switch + [v] * (120 - switch)


async def test_a_request_that_comes_during_a_ring_runs_after_it_on_the_new_weights(engine, original):
    """The trainer's iterator holds back its last tensor, so the workers wait inside the receive;
    a request submitted then must not reach vLLM (it would run beside the copies, on half-updated
    weights) until the push landed."""
    new = perturbed(original, seed=7)
    sync = await connect_weight_sync([engine], "shm", bucket_bytes=BUCKET, timeout_s=60)
    try:
        v = engine.weight_version + 1

        def slow():
            items = list(new.items())
            yield from items[:-1]
            time.sleep(1.0)
            yield items[-1]

        pushing = asyncio.ensure_future(sync.push(slow(), version=v, specs=specs_of(new.items())))
        await asyncio.sleep(0.4)
        assert not pushing.done() and engine._door is not None and engine._door.busy
        during = await engine.generate(request())
        assert pushing.done()  # the request ran only once the update had landed
        await pushing
        assert (await last_receive(engine)).direct is True
        after = await engine.generate(request())
        assert [c.token_ids for c in during] == [c.token_ids for c in after]
        assert all(c.weight_version == v and c.token_weight_versions is None for c in during)
        await sync.push(original, version=v + 1)
    finally:
        await sync.close()
