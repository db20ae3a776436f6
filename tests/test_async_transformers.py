"""Async-RL primitives of the embedded `transformers` engine (issue 17).

Continuous batching (requests join and leave the running batch every step), request ids, streaming
with bounded buffers, abort, the three pause modes (a push while paused in ``keep`` mode, with
per-token weight versions), ``continue_from``, top-k and prompt logprobs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_engines import Completion, GenerateRequest, InvalidRequest, SamplingParams, create_engine
from rollout_engines.backends.transformers.engine import TransformersEngine
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.session import connect_weight_sync

pytestmark = pytest.mark.transformers

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Once", "import numpy as np\nx = np.zeros(3)"]
PATIENCE_S = 30  # for waits on a busy machine
PROMPTLY_S = 2.0  # abort latency bound


def greedy(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def endless(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True, **kw)


def make(tiny_model: Path, **options: Any) -> TransformersEngine:
    e = create_engine("transformers", model=str(tiny_model), dtype="float32", **options)
    assert isinstance(e, TransformersEngine)
    return e


def made(engine: TransformersEngine, rid: str) -> int:
    """Tokens generated so far by the running row with request id ``rid`` (0 before it started)."""
    hit = engine._ids.get(rid)
    if hit is None or hit[0].rows is None:
        return 0
    return len(hit[0].rows[hit[1]].tokens)


async def push(e: TransformersEngine, tensors: Any, version: int) -> int:
    sync = await connect_weight_sync([e], "inproc", timeout_s=60)
    try:
        return await sync.push(tensors, version=version)
    finally:
        await sync.close()


def ids(outs: list[Completion]) -> list[list[int]]:
    return [c.token_ids for c in outs]


# ---- request ids and continuous batching -------------------------------------------------------
async def test_request_ids_on_every_completion(engine: TransformersEngine) -> None:
    rids = [f"r{i}" for i in range(4)]
    outs = await engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(3, n=2), request_ids=rids))
    assert [c.request_id for c in outs] == rids
    assert [(c.prompt_index, c.sample_index) for c in outs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    fresh = await engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(3)))
    assert all(c.request_id for c in fresh) and len({c.request_id for c in fresh}) == 2


async def test_duplicate_running_request_id_is_refused(engine: TransformersEngine, wait_until: Callable[..., Any]) -> None:
    long = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=endless(),
                                                                 request_ids=["same"])))
    await wait_until(lambda: made(engine, "same") > 0, "the long request runs")
    with pytest.raises(InvalidRequest, match="still running"):
        await engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(2), request_ids=["same"]))
    await engine.abort(["same"])
    assert (await asyncio.wait_for(long, PATIENCE_S))[0].finish_reason == "abort"
    again = await engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(2), request_ids=["same"]))
    assert again[0].request_id == "same"


async def test_a_request_joins_the_running_batch_and_finishes_first(engine: TransformersEngine, wait_until: Callable[..., Any]) -> None:
    short = GenerateRequest(prompts=PROMPTS[1:2], sampling=greedy(8))
    alone = await engine.generate(short)
    long = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=endless(),
                                                                 request_ids=["long"])))
    await wait_until(lambda: made(engine, "long") >= 5, "the long request runs")
    joined = await asyncio.wait_for(engine.generate(short), PATIENCE_S)
    assert not long.done(), "the short request had to wait for the long one"
    assert ids(joined) == ids(alone)
    await engine.abort(["long"])
    out = (await asyncio.wait_for(long, PATIENCE_S))[0]
    assert out.finish_reason == "abort" and 5 <= len(out.token_ids) < 1500


async def test_many_concurrent_requests_join_mid_batch(engine: TransformersEngine) -> None:
    requests = [GenerateRequest(prompts=[PROMPTS[i % 4] + f" {i}"], sampling=greedy(4 + (7 * i) % 23))
                for i in range(16)]
    requests.append(GenerateRequest(prompts=PROMPTS[:2], sampling=SamplingParams(
        temperature=1.0, max_tokens=12, seed=7, n=2, ignore_eos=True)))
    alone = [await engine.generate(r) for r in requests]
    batches = engine.batches_run

    async def late(i: int, r: GenerateRequest) -> list[Completion]:
        await asyncio.sleep(0.003 * i)  # arriving while the earlier ones are being stepped
        return await engine.generate(r)

    together = await asyncio.wait_for(asyncio.gather(*(late(i, r) for i, r in enumerate(requests))), PATIENCE_S)
    for a, b in zip(alone, together, strict=True):
        assert ids(a) == ids(b)
        assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    assert engine.batches_run > batches
    info = await engine.info()
    assert info.extra["running"] == 0 and info.extra["running_rows"] == 0 and info.extra["pending_rows"] == 0


# ---- streaming -----------------------------------------------------------------------------------
async def test_stream_equals_generate_for_greedy(engine: TransformersEngine) -> None:
    s = greedy(20, n=2, logprobs=1, top_logprobs=3)
    request = GenerateRequest(prompts=PROMPTS[:3], sampling=s, request_ids=[f"s{i}" for i in range(6)])
    outs = await engine.generate(request)
    got: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    finish: dict[str, str] = {}
    async for d in engine.stream(request):
        assert d.request_id not in finish, "nothing follows a sequence's last delta"
        got.setdefault(d.request_id, []).extend(d.token_ids)
        lps.setdefault(d.request_id, []).extend(d.logprobs or [])
        assert d.top_logprobs is not None and len(d.top_logprobs) == len(d.token_ids)
        assert d.weight_version == 0
        if d.finish_reason is not None:
            finish[d.request_id] = d.finish_reason
    for c in outs:
        assert got[c.request_id] == c.token_ids
        assert lps[c.request_id] == pytest.approx(c.logprobs, abs=1e-4)
        assert finish[c.request_id] == c.finish_reason == "length"


async def test_a_slow_consumer_holds_a_bounded_buffer(tiny_model: Path) -> None:
    engine = make(tiny_model, stream_buffer_tokens=4)
    try:
        request = GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(60))
        expected = ids(await engine.generate(request))
        # Another request keeps the worker stepping while the stream waits for its consumer.
        other = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[2:3], sampling=greedy(300))))
        got: dict[int, list[int]] = {0: [], 1: []}
        parked_seen = False
        async for d in engine.stream(request):
            assert len(d.token_ids) <= 4
            got[d.prompt_index].extend(d.token_ids)
            await asyncio.sleep(0.02)  # slow: the engine is far faster than this
            info = await engine.info()
            parked_seen = parked_seen or info.extra["parked_rows"] > 0
            assert engine.stream_buffer_peak <= 4
        assert [got[0], got[1]] == expected
        assert parked_seen, "a row whose consumer was behind should have waited out of the batch"
        assert engine.stream_buffer_peak <= 4
        assert len((await asyncio.wait_for(other, PATIENCE_S))[0].token_ids) == 300
    finally:
        await engine.close()


async def test_a_stream_left_early_stops_its_rows(engine: TransformersEngine, wait_until: Callable[..., Any]) -> None:
    request = GenerateRequest(prompts=PROMPTS[:1], sampling=endless(), request_ids=["left"])
    agen = engine.stream(request)
    async for d in agen:
        if d.token_ids:
            break
    await agen.aclose()
    await wait_until(lambda: (engine._extra_info()["running"] == 0), "the stream's request is gone")
    assert (await engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(3))))[0].token_ids


# ---- abort ---------------------------------------------------------------------------------------
async def test_abort_returns_partial_results_promptly(engine: TransformersEngine, wait_until: Callable[..., Any]) -> None:
    rids = ["a0", "a1"]
    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=endless(n=2),
                                                                 request_ids=rids)))
    await wait_until(lambda: made(engine, "a0") >= 5, "tokens are being made")
    await engine.abort(["unknown-id"])  # ignored
    start = time.monotonic()
    await engine.abort(["a0"])
    await wait_until(lambda: engine._ids.get("a0") is None or made(engine, "a1") > made(engine, "a0") + 3,
                     "a1 goes on without a0")
    assert not task.done(), "the other sample of the request goes on"
    await engine.abort(["a1"])
    outs = await asyncio.wait_for(task, PROMPTLY_S)
    assert time.monotonic() - start < PROMPTLY_S + 1
    assert [c.finish_reason for c in outs] == ["abort", "abort"]
    assert 5 <= len(outs[0].token_ids) < len(outs[1].token_ids) < 1500
    await engine.abort(rids)  # finished: ignored
    full = await engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(len(outs[1].token_ids))))
    assert full[0].token_ids == outs[1].token_ids, "the partial tokens are the real prefix"


async def test_abort_all_and_abort_of_a_queued_request(engine: TransformersEngine, wait_until: Callable[..., Any]) -> None:
    gate = threading.Event()
    blocker = asyncio.ensure_future(engine._call(gate.wait))
    queued = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=endless(),
                                                                   request_ids=["q0", "q1"])))
    await wait_until(lambda: "q0" in engine._ids, "the request is queued")
    await engine.abort(["q0", "q1"])
    outs = await asyncio.wait_for(queued, PROMPTLY_S)  # answered while the worker is still held
    assert [(c.request_id, c.finish_reason, c.token_ids) for c in outs] == [("q0", "abort", []), ("q1", "abort", [])]
    gate.set()
    await blocker
    running = [asyncio.ensure_future(engine.generate(GenerateRequest(prompts=[p], sampling=endless(),
                                                                     request_ids=[f"r{i}"])))
               for i, p in enumerate(PROMPTS)]
    await wait_until(lambda: all(made(engine, f"r{i}") > 0 for i in range(len(PROMPTS))), "all four make tokens")
    await engine.abort_all()
    done = await asyncio.wait_for(asyncio.gather(*running), PROMPTLY_S)
    assert all(r[0].finish_reason == "abort" and 0 < len(r[0].token_ids) < 1500 for r in done)


async def test_abort_ends_a_stream_with_an_abort_delta(engine: TransformersEngine) -> None:
    request = GenerateRequest(prompts=PROMPTS[:1], sampling=endless(), request_ids=["st"])
    tokens: list[int] = []
    last = None
    async for d in engine.stream(request):
        tokens += d.token_ids
        if len(tokens) >= 10 and last is None:
            last = "asked"
            await engine.abort(["st"])
        if d.finish_reason is not None:
            last = d.finish_reason
    assert last == "abort" and 10 <= len(tokens) < 1500


# ---- pause modes ---------------------------------------------------------------------------------
async def test_pause_wait_drains_and_admits_nothing_new(engine: TransformersEngine, wait_until: Callable[..., Any]) -> None:
    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(200),
                                                                 request_ids=["w"])))
    await wait_until(lambda: made(engine, "w") > 0, "it runs")
    await engine.pause("wait")
    assert task.done() and (await task)[0].finish_reason == "length" and len((await task)[0].token_ids) == 200
    later = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(2))))
    await asyncio.sleep(0.2)
    assert not later.done()
    await engine.resume()
    assert len((await asyncio.wait_for(later, PATIENCE_S))[0].token_ids) == 2


async def test_pause_abort_returns_partial_results(engine: TransformersEngine, wait_until: Callable[..., Any]) -> None:
    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=endless(),
                                                                 request_ids=["pa"])))
    await wait_until(lambda: made(engine, "pa") >= 3, "it runs")
    await asyncio.wait_for(engine.pause("abort"), PROMPTLY_S)
    out = (await task)[0]
    assert out.finish_reason == "abort" and 3 <= len(out.token_ids) < 1500
    await engine.resume()


async def test_abort_of_requests_held_by_a_pause(engine: TransformersEngine) -> None:
    await engine.pause("keep")
    held = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=endless(),
                                                                 request_ids=["h"])))
    half = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(200),
                                                                 request_ids=["h0", "h1"])))

    async def consume() -> list[Any]:
        request = GenerateRequest(prompts=PROMPTS[:1], sampling=endless(), request_ids=["hs"])
        return [d async for d in engine.stream(request)]

    streamed = asyncio.ensure_future(consume())
    other = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(3))))
    await asyncio.sleep(0.05)  # all four reach the pause's gate in the loop's next round
    assert not any(t.done() for t in (held, half, streamed, other)) and (await engine.info()).outstanding == 0
    await engine.abort(["h", "hs", "h0"])
    await engine.resume()
    out = (await asyncio.wait_for(held, PROMPTLY_S))[0]
    assert (out.request_id, out.finish_reason, out.token_ids) == ("h", "abort", [])  # never ran
    assert [(d.request_id, d.finish_reason, d.token_ids) for d in await asyncio.wait_for(streamed, PROMPTLY_S)] \
        == [("hs", "abort", [])]
    h0, h1 = await asyncio.wait_for(half, PATIENCE_S)  # runs; its aborted id ends as soon as it started
    assert (h0.finish_reason, h1.finish_reason) == ("abort", "length") and len(h0.token_ids) < 200
    assert len((await asyncio.wait_for(other, PATIENCE_S))[0].token_ids) == 3  # not aborted: runs in full


async def test_abort_all_ends_requests_held_by_a_pause(engine: TransformersEngine) -> None:
    await engine.pause("keep")
    held = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=endless())))
    await asyncio.sleep(0.05)
    await engine.abort_all()
    await engine.resume()
    outs = await asyncio.wait_for(held, PROMPTLY_S)
    assert [(c.finish_reason, c.token_ids) for c in outs] == [("abort", []), ("abort", [])]


async def test_pause_keep_push_resume_continues_with_new_weights(engine: TransformersEngine, tiny_model: Path, wait_until: Callable[..., Any]) -> None:
    original = load_checkpoint(tiny_model)
    prompt = PROMPTS[:1]
    n = 200  # long enough that the pause lands before the row ends on a quick or a stalled machine
    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=prompt, sampling=greedy(n, logprobs=1),
                                                                 request_ids=["k"])))
    await wait_until(lambda: made(engine, "k") >= 5, "it runs")
    await engine.pause("keep")
    frozen_at = made(engine, "k")
    await asyncio.sleep(0.2)
    assert made(engine, "k") == frozen_at and not task.done(), "a kept row must not move while paused"
    assert await push(engine, perturbed(original), 1) == 1
    await engine.resume()
    out = (await asyncio.wait_for(task, PATIENCE_S))[0]
    assert out.weight_version == 1 and len(out.token_ids) == n
    versions = out.versions()
    assert versions == [0] * frozen_at + [1] * (n - frozen_at)
    assert out.token_weight_versions == versions
    # The first tokens are the old weights' greedy tokens; the rest are exactly what the new weights
    # make from prompt + those tokens (the kept row's KV was recomputed).
    after = await engine.generate(GenerateRequest(
        prompts=prompt, sampling=greedy(n - frozen_at, logprobs=1),
        continue_from=[Completion(prompt_index=0, token_ids=out.token_ids[:frozen_at],
                                  logprobs=out.logprobs[:frozen_at], finish_reason="abort", weight_version=0)]))
    assert after[0].token_ids == out.token_ids
    assert after[0].logprobs == pytest.approx(out.logprobs, abs=1e-4)
    await push(engine, original, 2)
    reference = await engine.generate(GenerateRequest(prompts=prompt, sampling=greedy(n)))
    assert reference[0].token_ids[:frozen_at] == out.token_ids[:frozen_at]


async def test_keep_kv_option_keeps_the_old_cache(tiny_model: Path, wait_until: Callable[..., Any]) -> None:
    engine = make(tiny_model, keep_kv_on_weight_change=True)
    n = 200  # long enough that the pause lands before the row ends on a quick or a stalled machine
    try:
        task = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(n),
                                                                     request_ids=["kk"])))
        await wait_until(lambda: made(engine, "kk") >= 5, "it runs")
        await engine.pause("keep")
        frozen_at = made(engine, "kk")
        row = engine._ids["kk"][0].rows[0]  # type: ignore[index]
        await push(engine, perturbed(load_checkpoint(tiny_model)), 1)
        await engine.resume()
        out = (await asyncio.wait_for(task, PATIENCE_S))[0]
        # The next token's logits were computed by the old weights before the pause.
        assert out.versions() == [0] * (frozen_at + 1) + [1] * (n - frozen_at - 1)
        assert row.prefills == 1, "the old KV was kept, not recomputed"
    finally:
        await engine.close()


async def test_sleep_while_kept_recomputes_the_cache(engine: TransformersEngine, wait_until: Callable[..., Any]) -> None:
    # Long enough that the pause lands while the rows run (a finished row would leave nothing to keep).
    request = GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(200), request_ids=["z0", "z1"])
    reference = ids(await engine.generate(request))
    task = asyncio.ensure_future(engine.generate(request))
    await wait_until(lambda: made(engine, "z0") >= 5, "it runs")
    await engine.pause("keep")
    await engine.sleep(1)
    assert engine._extra_info()["running_rows"] == 0, "sleep gives the kept rows' KV back"
    await engine.wake_up()
    await engine.resume()
    outs = await asyncio.wait_for(task, PATIENCE_S)
    assert ids(outs) == reference and all(c.token_weight_versions is None for c in outs)


# ---- continue_from -------------------------------------------------------------------------------
async def test_continue_from_gives_the_whole_response(engine: TransformersEngine, tiny_model: Path) -> None:
    whole = await engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(12, logprobs=1)))
    first = await engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(5, logprobs=1)))
    rest = await engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(7, logprobs=1),
                                                 continue_from=first))
    for w, r in zip(whole, rest, strict=True):
        assert r.token_ids == w.token_ids and r.text == w.text
        assert r.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert r.token_weight_versions is None and r.weight_version == 0
    with pytest.raises(InvalidRequest, match="logprob"):
        await engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(2, logprobs=1),
                                              continue_from=await engine.generate(
                                                  GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(2)))))
    # Across a push: the earlier tokens keep their version, the new ones have the new one.
    original = load_checkpoint(tiny_model)
    await push(engine, perturbed(original), 1)
    more = await engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(4), continue_from=first))
    for m, f in zip(more, first, strict=True):
        assert m.token_ids[:5] == f.token_ids and len(m.token_ids) == 9
        assert m.token_weight_versions == [0] * 5 + [1] * 4 and m.weight_version == 1
    again = await engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(3), continue_from=more))
    assert [c.versions() for c in again] == [[0] * 5 + [1] * 7] * 2
    await push(engine, original, 2)


# ---- logprobs ------------------------------------------------------------------------------------
async def test_top_logprobs_sorted_with_the_sampled_token(engine: TransformersEngine) -> None:
    s = SamplingParams(temperature=1.5, max_tokens=12, seed=3, logprobs=1, top_logprobs=2, ignore_eos=True)
    outs = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=s))
    outside = 0
    for c in outs:
        assert c.top_logprobs is not None and c.logprobs is not None and len(c.top_logprobs) == len(c.token_ids)
        for token, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
            values = [t.logprob for t in top]
            assert values == sorted(values, reverse=True)
            assert len(top) in (2, 3) and token in [t.token_id for t in top]
            assert next(t.logprob for t in top if t.token_id == token) == pytest.approx(lp, abs=1e-5)
            outside += len(top) == 3
    assert outside, "at temperature 1.5 some sampled tokens fall outside the top 2"
    zero = await engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(3, top_logprobs=0)))
    assert zero[0].top_logprobs is not None and [len(t) for t in zero[0].top_logprobs] == [1, 1, 1]


async def test_prompt_logprobs_match_a_forward_pass(engine: TransformersEngine, tiny_model: Path,
                                                    request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM

    outs = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(2, prompt_logprobs=3)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    for c in outs:
        p = c.prompt_token_ids
        with torch.no_grad():
            lsm = model(torch.tensor([p])).logits[0].float().log_softmax(-1)
        ref = lsm[:-1].gather(-1, torch.tensor(p[1:])[:, None])[:, 0].tolist()
        assert c.prompt_logprobs is not None and c.prompt_logprobs[0] is None
        assert c.prompt_logprobs[1:] == pytest.approx(ref, abs=1e-4)
        assert c.prompt_top_logprobs is not None and len(c.prompt_top_logprobs) == len(p)
        assert c.prompt_top_logprobs[0] == []
        for j, top in enumerate(c.prompt_top_logprobs[1:]):
            want = lsm[j].topk(3)
            assert [t.token_id for t in top[:3]] == want.indices.tolist()
            assert p[j + 1] in [t.token_id for t in top]
    plain = await engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(2, prompt_logprobs=0)))
    assert plain[0].prompt_logprobs is not None and plain[0].prompt_top_logprobs is None
