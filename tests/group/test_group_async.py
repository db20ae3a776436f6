"""EngineGroup's async-RL methods (issue 17) on two real transformers engines in this process:
abort routed to the member that owns each request id, abort_all and pause/resume fanned out (with
the members' common pause modes), streams routed like generate, continue_from back to the member
that produced the earlier completion."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from echo_engine import EchoEngine
from rollout_engines import CapabilityError, EngineGroup, GenerateRequest, SamplingParams, create_engine
from rollout_engines.backends.transformers.engine import TransformersEngine
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(300)]

PATIENCE_S = 30.0
PROMPTLY_S = 2.0


def endless(max_tokens: int = 1500, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def req(rid: str, max_tokens: int = 1500, **kw: Any) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=endless(max_tokens), request_ids=[rid], **kw)


def made(engine: TransformersEngine, rid: str) -> int:
    hit = engine._ids.get(rid)
    if hit is None or hit[0].rows is None:
        return 0
    return len(hit[0].rows[hit[1]].tokens)


def runner(engines: list[TransformersEngine], rid: str) -> int | None:
    """Index of the engine running request id ``rid`` (None: none does)."""
    return next((i for i, e in enumerate(engines) if made(e, rid) > 0), None)


@pytest.fixture
async def pair(tiny_model: Path) -> AsyncIterator[tuple[EngineGroup, list[TransformersEngine]]]:
    engines = [create_engine("transformers", model=str(tiny_model), dtype="float32") for _ in range(2)]
    assert all(isinstance(e, TransformersEngine) for e in engines)
    group = EngineGroup(engines, routing="round_robin", health_interval_s=None)
    yield group, engines  # type: ignore[misc]
    await group.close()


async def test_abort_goes_to_the_member_that_runs_each_id(pair, wait_until: Callable[..., Any]) -> None:
    group, engines = pair
    a = asyncio.ensure_future(group.generate(req("a")))
    b = asyncio.ensure_future(group.generate(req("b")))
    await wait_until(lambda: runner(engines, "a") is not None and runner(engines, "b") is not None, "both run")
    ia, ib = runner(engines, "a"), runner(engines, "b")
    assert ia != ib  # round robin: one each
    assert group._owners["a"] is group._members[ia] and group._owners["b"] is group._members[ib]
    start = time.monotonic()
    await group.abort(["a", "no-such-id"])
    out_a = (await asyncio.wait_for(a, PATIENCE_S))[0]
    assert time.monotonic() - start < PROMPTLY_S
    assert out_a.finish_reason == "abort" and out_a.request_id == "a" and 0 < len(out_a.token_ids) < 1500
    b_at = made(engines[ib], "b")
    await wait_until(lambda: made(engines[ib], "b") >= b_at + 5, "'b' to go on")
    assert not b.done(), "aborting 'a' must leave 'b' (on the other member) running"
    assert "a" not in group._owners  # finished ids are forgotten
    await group.abort(["a"])  # a finished id: no-op
    await group.abort(["b"])
    out_b = (await asyncio.wait_for(b, PATIENCE_S))[0]
    assert out_b.finish_reason == "abort"
    assert group._owners == {}


async def test_abort_all_and_pause_abort_fan_out(pair, wait_until: Callable[..., Any]) -> None:
    group, engines = pair
    tasks = [asyncio.ensure_future(group.generate(req(f"r{i}"))) for i in range(4)]
    await wait_until(lambda: all(runner(engines, f"r{i}") is not None for i in range(4)), "all run")
    assert {runner(engines, f"r{i}") for i in range(4)} == {0, 1}
    await group.abort_all()
    outs = await asyncio.wait_for(asyncio.gather(*tasks), PATIENCE_S)
    assert [o[0].finish_reason for o in outs] == ["abort"] * 4
    tasks = [asyncio.ensure_future(group.generate(req(f"s{i}"))) for i in range(2)]
    await wait_until(lambda: all(runner(engines, f"s{i}") is not None for i in range(2)), "all run")
    await group.pause("abort")
    outs = await asyncio.wait_for(asyncio.gather(*tasks), PATIENCE_S)
    assert [o[0].finish_reason for o in outs] == ["abort"] * 2
    assert all(e._paused and e._pause_mode == "abort" for e in engines)
    await group.resume()
    assert not any(e._paused for e in engines)
    out = await group.generate(req("after", max_tokens=3))
    assert out[0].finish_reason == "length"


async def test_abort_of_a_request_waiting_in_the_group(tiny_model: Path, wait_until: Callable[..., Any]) -> None:
    engine = create_engine("transformers", model=str(tiny_model), dtype="float32")
    group = EngineGroup([engine], max_outstanding_per_engine=1, health_interval_s=None)
    try:
        first = asyncio.ensure_future(group.generate(req("first")))
        await wait_until(lambda: made(engine, "first") > 0, "it runs")  # type: ignore[arg-type]
        queued = asyncio.ensure_future(group.generate(req("queued")))
        await wait_until(lambda: "queued" in group._owners, "it waits in the group")
        assert group._owners["queued"] is None
        await group.abort(["queued"])
        await group.abort(["first"])  # frees the slot: 'queued' reaches the engine and ends at once
        out = (await asyncio.wait_for(queued, PATIENCE_S))[0]
        assert out.finish_reason == "abort" and len(out.token_ids) < 1500
        assert (await first)[0].finish_reason == "abort"
    finally:
        await group.close()


async def test_pause_keep_push_resume_on_every_member(pair, tiny_model: Path, wait_until: Callable[..., Any]) -> None:
    group, engines = pair
    assert set(group.pause_modes()) == {"wait", "abort", "keep"}
    # Long enough that the freeze lands before either finishes however the two workers and the loop
    # share the cores (the wait polls every 2 ms; a stalled loop lets a row run on meanwhile).
    n = 1000
    tasks = [asyncio.ensure_future(group.generate(req(f"k{i}", max_tokens=n))) for i in range(2)]
    await wait_until(lambda: all(runner(engines, f"k{i}") is not None and made(engines[runner(engines, f"k{i}")],
                                                                           f"k{i}") >= 3 for i in range(2)), "both run")
    await group.pause("keep")
    assert all(e._frozen for e in engines)
    sync = await connect_weight_sync([group], "inproc", timeout_s=60)
    try:
        assert await sync.push(perturbed(load_checkpoint(tiny_model)), version=1) == 1
    finally:
        await sync.close()
    await group.resume()
    outs = [o[0] for o in await asyncio.wait_for(asyncio.gather(*tasks), PATIENCE_S)]
    for o in outs:
        versions = o.versions()
        assert o.weight_version == 1 and len(versions) == n
        assert versions[0] == 0 and versions[-1] == 1, versions  # each spans the push


async def test_pause_modes_are_what_every_member_has(tiny_model: Path) -> None:
    engine = create_engine("transformers", model=str(tiny_model), dtype="float32")
    group = EngineGroup([engine, EchoEngine("plain")], health_interval_s=None)
    try:
        assert group.pause_modes() == ("wait",)
        assert not group.capabilities.abort and not group.capabilities.streaming
        with pytest.raises(CapabilityError, match="keep"):
            await group.pause("keep")
        with pytest.raises(CapabilityError):
            await group.abort(["x"])
    finally:
        await group.close()


async def test_stream_stays_on_one_member_and_can_be_aborted(pair) -> None:
    group, engines = pair
    got: list[int] = []
    finish = None
    request = GenerateRequest(prompt_token_ids=[[5, 6, 7]], sampling=endless(), request_ids=["s"])
    async for delta in group.stream(request):
        assert delta.request_id == "s"
        got += delta.token_ids
        if len(got) >= 5 and finish is None and "s" in group._owners:
            owner = group._owners["s"]
            assert owner is not None
            assert made(engines[owner.index], "s") > 0 and made(engines[1 - owner.index], "s") == 0
            await group.abort(["s"])
            finish = "asked"
        if delta.finish_reason is not None:
            finish = delta.finish_reason
    assert finish == "abort" and 5 <= len(got) < 1500
    assert group._owners == {}
    # Without an abort a stream gives what generate gives (greedy), from one member.
    plain = GenerateRequest(prompt_token_ids=[[5, 6, 7]], sampling=endless(12))
    tokens = [t async for d in group.stream(plain) for t in d.token_ids]
    assert tokens == (await group.generate(plain))[0].token_ids


async def test_continue_from_goes_back_to_its_producer(pair) -> None:
    group, engines = pair
    first = (await group.generate(req("p0", max_tokens=4, )))[0]
    producer = group._produced["p0"]
    prior = first
    for k in range(4):  # round robin would alternate; continuation sticks to the producer
        request = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=endless(2),
                                  continue_from=[prior], request_ids=[f"p{k + 1}"])
        prior = (await group.generate(request))[0]
        assert group._produced[f"p{k + 1}"] == producer
        assert len(prior.token_ids) == 4 + 2 * (k + 1)
    assert group.member_stats()[producer]["completed"] == 5
    # A stream continues on the producer too.
    request = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=endless(2),
                              continue_from=[prior], request_ids=["p-stream"])
    assert len([d async for d in group.stream(request)]) >= 1
    assert group._produced["p-stream"] == producer
    # The producer is down: any member continues.
    group._mark_down(group._members[producer], "test: taken out")
    request = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=endless(2),
                              continue_from=[prior], request_ids=["p-other"])
    out = (await group.generate(request))[0]
    assert group._produced["p-other"] == 1 - producer and len(out.token_ids) == len(prior.token_ids) + 2
