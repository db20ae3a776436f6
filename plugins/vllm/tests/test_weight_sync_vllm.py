"""Weight pushes into real vLLM workers over every CPU transport, with the faults of a real run.

The test process is the trainer; vLLM's worker (in vLLM's engine-core process) is the receiver,
through the plugin's worker extension. One engine serves the whole module (vLLM starts in ~15 s).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from rollout_engines import GenerateRequest, SamplingParams, create_engine
from rollout_engines.errors import ManifestMismatch, WeightSyncError
from rollout_engines.testing.trainer import trainer_killed_mid_stream
from rollout_engines.weights.session import connect_weight_sync
from trainer_proc import SESSION, trainer_main, update

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

CPU_TRANSPORTS = ["gloo", "shm", "disk"]
#: Small buckets, so an update of the tiny model (~3 MB) spans several.
BUCKET = 256 * 1024


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = create_engine("vllm", model=str(tiny_model), dtype="float32")
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def request_(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    texts = ["The quick brown fox", "def add(a, b):", "Once upon a time there was a"]
    ids = [list(tok(t)["input_ids"]) for t in texts]
    return GenerateRequest(prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))


async def tokens(engine, request):
    return [c.token_ids for c in await engine.generate(request)]


def caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


async def push(engine, tensors, version, transport="gloo", partial=False, **kw):
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=60, **kw)
    try:
        return await sync.push(tensors, version=version, partial=partial)
    finally:
        await sync.close()


async def test_workers_are_separate_receivers(engine):
    info = await engine.info()
    workers = info.extra["workers"]
    assert engine.weight_receivers() == len(workers) == engine.config.tensor_parallel_size
    assert all(w["pid"] != os.getpid() for w in workers), "vLLM's worker must run outside the trainer"
    assert set(engine.capabilities.transports) >= set(CPU_TRANSPORTS)


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_push_changes_outputs_and_restore_restores(engine, original, request_, tiny_model, transport):
    before = await tokens(engine, request_)
    v0 = engine.weight_version
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=60)
    try:
        await sync.push(update(str(tiny_model)), version=v0 + 1)
        outs = await engine.generate(request_)
        assert [c.token_ids for c in outs] != before
        assert all(c.weight_version == v0 + 1 for c in outs)
        await sync.push(original, version=v0 + 2)  # same session, second update
        assert await tokens(engine, request_) == before
        assert (await engine.info()).weight_version == v0 + 2
    finally:
        await sync.close()


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_bad_manifest_rejected_whole_then_next_push_works(engine, original, request_, tiny_model, transport):
    before = await tokens(engine, request_)
    v0 = engine.weight_version
    bad = update(str(tiny_model))  # if any of it landed, outputs would change
    bad["model.norm.weight"] = torch.ones(7)
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=60)
    try:
        with pytest.raises(WeightSyncError) as info:
            await sync.push(bad, version=v0 + 1)
        assert caused_by(info.value, ManifestMismatch)
        assert "model.norm.weight" in str(info.value)
        assert await tokens(engine, request_) == before
        assert engine.weight_version == v0
        # The same session takes the next, valid update.
        await sync.push(update(str(tiny_model)), version=v0 + 1)
        assert await tokens(engine, request_) != before
        await sync.push(original, version=v0 + 2)
        assert await tokens(engine, request_) == before
    finally:
        await sync.close()


async def test_part_of_a_fused_module_is_rejected(engine, original, request_, tiny_model):
    """vLLM loads q/k/v into one qkv_proj: an update with q_proj alone would leave k and v
    undefined, so it is refused before anything is applied."""
    before = await tokens(engine, request_)
    v0 = engine.weight_version
    partial = {k: v for k, v in update(str(tiny_model)).items() if ".q_proj." in k}
    with pytest.raises(WeightSyncError) as info:
        await push(engine, partial, v0 + 1, partial=True)
    assert caused_by(info.value, ManifestMismatch)
    assert "qkv_proj" in str(info.value) and "k_proj" in str(info.value)
    assert await tokens(engine, request_) == before
    assert engine.weight_version == v0
    # Whole modules are fine, even if the update is partial: one layer's attention only.
    layer0 = {k: v for k, v in update(str(tiny_model)).items() if k.startswith("model.layers.0.self_attn.")}
    await push(engine, layer0, v0 + 1, partial=True)
    assert await tokens(engine, request_) != before
    await push(engine, original, v0 + 2)
    assert await tokens(engine, request_) == before


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_trainer_killed_mid_stream(engine, original, request_, tiny_model, transport):
    before = await tokens(engine, request_)
    v0 = engine.weight_version
    timeout_s = 8.0 if transport == "disk" else 60.0  # disk has no liveness channel, only its timeout
    update_ = update(str(tiny_model))
    async with trainer_killed_mid_stream(engine, trainer_main, (transport, timeout_s, str(tiny_model), BUCKET, 3),
                                         transport=transport, session_id=SESSION, tensors=update_, version=v0 + 1,
                                         bucket_bytes=BUCKET, timeout_s=timeout_s) as (receiving, manifest):
        assert len(manifest.buckets) >= 3
        with pytest.raises(WeightSyncError) as info:
            await asyncio.wait_for(receiving, timeout_s + 60)
        assert "trainer" in str(info.value) and "bucket" in str(info.value), str(info.value)
    # Staged apply: nothing of the interrupted update is served, and the engine still answers.
    assert await tokens(engine, request_) == before
    assert engine.weight_version == v0
    # A new trainer session works right away.
    await push(engine, update_, v0 + 1, transport=transport)
    assert await tokens(engine, request_) != before
    await push(engine, original, v0 + 2, transport=transport)
    assert await tokens(engine, request_) == before


async def test_no_stale_prefix_cache_after_push(engine, original, tiny_model):
    """vllm#17103: KV blocks cached with the old weights must not serve prompts after an update.
    A long prompt fills many prefix-cache blocks; after the push its output must equal the output
    computed with the cache explicitly emptied."""
    prompt = [[(i * 37) % 4000 + 10 for i in range(300)]]
    req = GenerateRequest(prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    v0 = engine.weight_version
    before = await tokens(engine, req)
    assert await tokens(engine, req) == before  # now cached
    await push(engine, update(str(tiny_model)), v0 + 1)
    after = await tokens(engine, req)
    await engine.reset_prefix_cache()
    fresh = await tokens(engine, req)
    assert after == fresh
    assert after != before
    await push(engine, original, v0 + 2)
    assert await tokens(engine, req) == before


async def test_salted_prefix_cache_needs_no_reset_after_a_push(tiny_model, original):
    """``prefix_cache_isolation="salt"``: each request carries vLLM's ``cache_salt`` for the weight
    version it starts under, so the blocks a long prompt cached under v0 cannot serve it under v1,
    and the push skips the reset (``last_reset_s`` 0.0) although requests were generated."""
    eng = await asyncio.to_thread(create_engine, "vllm", str(tiny_model), dtype="float32",
                                  prefix_cache_isolation="salt")
    try:
        prompt = [[(i * 41) % 4000 + 10 for i in range(300)]]
        req = GenerateRequest(prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        before = await tokens(eng, req)
        assert await tokens(eng, req) == before  # now cached under v0's salt
        await push(eng, update(str(tiny_model)), 1)
        assert (await eng.diagnostics()).last_reset_s == 0.0
        after = await tokens(eng, req)
        await eng.reset_prefix_cache()  # an explicit reset still resets
        assert (await eng.diagnostics()).last_reset_s > 0
        assert after == await tokens(eng, req) and after != before
        await push(eng, original, 2)
        assert await tokens(eng, req) == before
    finally:
        await eng.close()


async def test_prefix_cache_reset_after_a_push_is_skipped_only_when_nothing_was_generated(engine, original, request_):
    """vLLM's reset walks every KV block (~10 ms on a big GPU): after a push it runs when requests
    were submitted since the last reset, and is skipped when none were (nothing can be cached)."""
    await tokens(engine, request_)
    await push(engine, original, engine.weight_version + 1)
    assert (await engine.diagnostics()).last_reset_s > 0
    await push(engine, original, engine.weight_version + 1)
    assert (await engine.diagnostics()).last_reset_s == 0.0
    before = await tokens(engine, request_)
    await push(engine, original, engine.weight_version + 1)
    diagnostics = await engine.diagnostics()
    assert diagnostics.last_reset_s > 0
    assert diagnostics.platform == engine.platform and diagnostics.weights_dtype == "float32"
    assert diagnostics.last_receive is not None and diagnostics.last_receive.version == engine.weight_version
    assert diagnostics.last_receive.rpc_s > 0 and diagnostics.last_receive.workers[0].total_s > 0
    # option direct_receive is off by default on the CPU: every push took vLLM's collective_rpc
    assert diagnostics.last_receive.direct is False and (await engine.info()).extra["direct_receive"] is False
    assert await tokens(engine, request_) == before


async def test_multiprocessing_mode_receives_too(tiny_model, original, request_):
    """With VLLM_ENABLE_V1_MULTIPROCESSING=1 the worker runs in a third process (not in vLLM's
    engine-core process); collective_rpc and the gloo group work the same."""
    eng = await asyncio.to_thread(create_engine, "vllm", str(tiny_model), dtype="float32", multiprocessing=True)
    try:
        info = await eng.info()
        assert info.extra["multiprocessing"] is True
        # the worker answers for itself from its own process; no sleep-mode allocator on the CPU
        (worker,) = info.extra["workers"]
        assert worker["rank"] == 0 and worker["pid"] != os.getpid() and "weight_allocations" not in worker
        before = await tokens(eng, request_)
        await push(eng, update(str(tiny_model)), 1)
        assert await tokens(eng, request_) != before
        await push(eng, original, 2)
        assert await tokens(eng, request_) == before
    finally:
        await eng.close()


async def test_pause_push_resume_keeps_in_flight_requests(engine, original, tiny_model):
    """Async RL: pause generation, push, resume. Requests in flight when paused are kept (vLLM's
    'keep' mode) and finish after resume; none is lost or answered twice."""
    long = GenerateRequest(prompt_token_ids=[[5, 6, 7], [8, 9, 10]],
                           sampling=SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
    v0 = engine.weight_version
    in_flight = asyncio.ensure_future(engine.generate(long))
    await asyncio.sleep(0.2)
    await engine.pause("keep")
    try:
        info = await engine.info()
        assert info.paused and info.outstanding == 1 and not in_flight.done()
        await push(engine, update(str(tiny_model)), v0 + 1)
    finally:
        await engine.resume()
    outs = await asyncio.wait_for(in_flight, 300)
    assert [len(c.token_ids) for c in outs] == [1000, 1000]
    assert [c.prompt_index for c in outs] == [0, 1]
    assert all(c.finish_reason == "length" for c in outs)
    await push(engine, original, v0 + 2)
