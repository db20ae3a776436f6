"""EngineGroup routing, backpressure, fan-out, weight-sync fan-out, failover and rejoin, on
EchoEngine members (no model: these are router tests, outputs only need to be deterministic)."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter

import pytest
import torch
from echo_engine import POISON, AbortableEcho, EchoEngine, echo_tokens
from rollout_engines import (
    CapabilityError,
    EngineAsleep,
    EngineClosed,
    EngineGroup,
    EngineUnavailable,
    GenerateRequest,
    SamplingParams,
    connect_weight_sync,
)
from safetensors.torch import save_file


def req(token: int = 1, tag: str | None = None, max_tokens: int = 2) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[[token]], session_id=tag, sampling=SamplingParams(max_tokens=max_tokens))


def group_of(n: int, **kw) -> tuple[EngineGroup, list[EchoEngine]]:
    workers = kw.pop("workers", 1)
    delay = kw.pop("delay_s", 0.0)
    engines = [EchoEngine(f"e{i}", delay_s=delay, workers=workers) for i in range(n)]
    kw.setdefault("health_interval_s", None)
    return EngineGroup(engines, **kw), engines


async def test_round_robin_spreads_evenly():
    group, engines = group_of(3, routing="round_robin")
    for _ in range(30):
        await group.generate(req())
    assert [e.calls for e in engines] == [10, 10, 10]


async def test_least_outstanding_prefers_the_faster_engine():
    slow, fast = EchoEngine("slow", delay_s=0.05), EchoEngine("fast", delay_s=0.002)
    group = EngineGroup([slow, fast], routing="least_outstanding", health_interval_s=None)

    async def worker() -> None:
        for _ in range(10):
            await group.generate(req())

    await asyncio.gather(*(worker() for _ in range(4)))
    assert slow.calls + fast.calls == 40
    assert fast.calls > 2 * slow.calls, (slow.calls, fast.calls)


async def test_sticky_sessions_stay_on_one_engine_and_move_only_while_it_is_down():
    group, engines = group_of(3, routing="sticky")
    sessions = [f"s{i}" for i in range(30)]
    for _ in range(3):
        for s in sessions:
            await group.generate(req(tag=s))
    owner = {s: next(i for i, e in enumerate(engines) if e.served[s]) for s in sessions}
    for s in sessions:
        assert engines[owner[s]].served[s] == 3  # every turn on the same engine
    assert len(set(owner.values())) == 3  # sessions are spread over all engines

    engines[0].crash()
    await group.check_health()
    moved = [s for s in sessions if owner[s] == 0]
    for s in sessions:
        for _ in range(2):
            await group.generate(req(tag=s))
        if owner[s] != 0:
            assert engines[owner[s]].served[s] == 5  # sessions of healthy engines do not move
        else:  # a moved session sticks to one new engine while its owner is down
            assert sorted(e.served[s] for e in engines[1:]) == [0, 2]

    engines[0].restart()
    await group.check_health()
    for s in moved:
        await group.generate(req(tag=s))
        assert engines[0].served[s] == 4  # back on its own engine


async def test_backpressure_bounds_requests_in_flight_per_engine():
    group, engines = group_of(2, delay_s=0.02, max_outstanding_per_engine=3)
    outs = await asyncio.gather(*(group.generate(req(i % 100)) for i in range(40)))
    assert len(outs) == 40
    assert [e.max_concurrent for e in engines] == [3, 3]
    assert sum(e.calls for e in engines) == 40


async def test_waiting_requests_are_served_in_arrival_order_and_cancelling_one_loses_no_slot():
    group, [engine] = group_of(1, delay_s=0.01, max_outstanding_per_engine=1)
    tags = [f"r{i}" for i in range(8)]
    tasks = []
    for t in tags:
        tasks.append(asyncio.ensure_future(group.generate(req(tag=t))))
        await asyncio.sleep(0)  # arrive one after the other
    tasks[3].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[3], asyncio.CancelledError)
    assert engine.order == [t for i, t in enumerate(tags) if i != 3]  # first come, first served
    assert engine.max_concurrent == 1
    assert (await group.info()).outstanding == 0


async def test_waiting_past_the_timeout_raises_engine_unavailable():
    group, engines = group_of(1, delay_s=0.5, max_outstanding_per_engine=1, wait_timeout_s=0.05)
    results = await asyncio.gather(*(group.generate(req()) for _ in range(3)), return_exceptions=True)
    assert sum(isinstance(r, list) for r in results) == 1
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 2 and all(isinstance(e, EngineUnavailable) for e in errors)
    assert "max_outstanding_per_engine" in str(errors[0])


async def test_failed_engine_requests_complete_exactly_once_on_the_others():
    group, engines = group_of(3, delay_s=0.05, max_outstanding_per_engine=20)
    tags = [f"r{i}" for i in range(200)]

    async def crash_soon() -> None:
        await asyncio.sleep(0.03)
        engines[1].crash()

    results, _ = await asyncio.gather(
        asyncio.gather(*(group.generate(req(i % 100, tag=t)) for i, t in enumerate(tags))), crash_soon()
    )
    assert len(results) == 200
    for i, out in enumerate(results):  # each caller got its own answer
        assert out[0].token_ids == echo_tokens(i % 100, 0, 2)
    served = Counter()
    for e in engines:
        served.update(e.served)
    assert set(served) == set(tags) and set(served.values()) == {1}  # none lost, none answered twice
    assert engines[1].calls > engines[1].served.total()  # it crashed with requests in flight
    assert group.retried > 0
    stats = group.member_stats()
    assert not stats[1]["serving"] and stats[1]["failures"] == 1
    assert stats[0]["serving"] and stats[2]["serving"]


async def test_a_stream_waiting_on_a_member_marked_down_is_retried_elsewhere():
    hung, ok = EchoEngine("hung", delay_s=1000.0), EchoEngine("ok")
    group = EngineGroup([hung, ok], routing="round_robin", health_interval_s=None)

    async def consume() -> list:
        return [d async for d in group.stream(req(3, tag="s"))]

    stream = asyncio.ensure_future(consume())  # round robin: member 0
    for _ in range(100):
        if hung.concurrent:
            break
        await asyncio.sleep(0.01)
    assert hung.concurrent == 1
    hung.crashed = True  # hung, not answering: its health check fails now
    await group.check_health()
    deltas = await asyncio.wait_for(stream, 5)  # evicted before its first delta: retried on member 1
    assert [t for d in deltas for t in d.token_ids] == echo_tokens(3, 0, 2) and deltas[-1].finish_reason == "length"
    assert ok.served["s"] == 1 and group.retried == 1 and hung.concurrent == 0


async def test_client_errors_are_raised_not_retried():
    group, engines = group_of(2)
    with pytest.raises(ValueError, match="token ids must be < 1000"):
        await group.generate(req(5000))
    with pytest.raises(RuntimeError, match="breaks the engine's code"):
        await group.generate(req(POISON))  # a bug with a healthy engine: not the engine's failure
    assert sum(e.calls for e in engines) == 2  # one attempt each
    assert group.retried == 0 and all(s["serving"] for s in group.member_stats())
    with pytest.raises(CapabilityError, match="stop on strings"):  # checked against the group's capabilities
        await group.generate(GenerateRequest(prompt_token_ids=[[1]], sampling=SamplingParams(stop=["x"])))


async def test_every_engine_down_raises_after_the_wait():
    group, engines = group_of(2, wait_timeout_s=0.1)
    for e in engines:
        e.crash()
    with pytest.raises(EngineUnavailable, match="0/2 serving"):
        await group.generate(req())
    assert not await group.health()


async def test_fan_out_of_sleep_wake_pause_resume_and_prefix_reset():
    group, engines = group_of(3)
    await group.sleep(level=1)
    assert [e.slept for e in engines] == [1, 1, 1]
    assert all(e.info is not None and e._asleep for e in engines)
    with pytest.raises(EngineAsleep):
        await group.generate(req())
    await group.wake_up()
    assert not any(e._asleep for e in engines)
    await group.reset_prefix_cache()
    assert all(e.prefix_resets >= 1 for e in engines)
    await group.pause()
    assert all(e.paused_calls == 1 and e._paused for e in engines)
    pending = asyncio.ensure_future(group.generate(req()))
    await asyncio.sleep(0.02)
    assert not pending.done()  # held while paused
    await group.resume()
    assert (await pending)[0].token_ids == echo_tokens(1, 0, 2)
    info = await group.info()
    assert info.backend == "group" and len(info.extra["members"]) == 3


async def test_a_member_down_while_the_group_changed_state_comes_back_in_the_groups_state():
    group, engines = group_of(2, routing="round_robin")
    await group.sleep(level=1)
    await group.pause()
    engines[0].crashed = True  # a transient failure: its health check fails
    assert await group.check_health() == [False, True]
    await group.wake_up()
    await group.resume()  # member 0 is down: neither reaches it
    assert engines[0]._asleep and engines[0]._paused
    engines[0].crashed = False
    assert await group.check_health() == [True, True]
    assert not engines[0]._asleep and not engines[0]._paused  # woken and resumed as it rejoined
    outs = await asyncio.wait_for(asyncio.gather(*(group.generate(req()) for _ in range(4))), 5)
    assert len(outs) == 4 and [e.calls for e in engines] == [2, 2]
    engines[1].crashed = True  # and the other way: down while the group slept and paused
    await group.check_health()
    await group.sleep(level=1)
    await group.pause()
    engines[1].crashed = False
    assert await group.check_health() == [True, True]
    assert engines[1]._asleep and engines[1]._paused


async def test_weight_push_reaches_every_worker_with_rank_offsets():
    group, engines = group_of(2, workers=2)
    single = EchoEngine("single", workers=2)
    assert group.weight_receivers() == 4
    sync = await connect_weight_sync([group, single], "inproc")
    try:
        assert [e.ranks for e in engines] == [[1, 2], [3, 4]]
        assert single.ranks == [5, 6]
        await sync.push({"bias": torch.full((2, 4), 2.0)}, version=7)
    finally:
        await sync.close()
    assert group.weight_version == 7 and (await group.info()).weight_version == 7
    for e in [*engines, single]:
        assert e.weight_version == 7 and e.offset() == 16  # both workers' rows arrived
    outs = [await group.generate(req(10)) for _ in range(4)]
    assert all(o[0].token_ids == echo_tokens(10, 16, 2) and o[0].weight_version == 7 for o in outs)


async def _push_bias(engine, value: float, version: int) -> None:
    sync = await connect_weight_sync([engine], "inproc")
    try:
        await sync.push({"bias": torch.full((1, 4), value)}, version=version)
    finally:
        await sync.close()


async def test_returning_engine_gets_the_latest_weights_before_traffic():
    pushed: list[tuple[str, int]] = []

    async def on_rejoin(engine, version):
        pushed.append((engine.name, version))
        await _push_bias(engine, 1.0, version)

    group, engines = group_of(3, on_rejoin=on_rejoin)
    await _push_bias(group, 1.0, 1)
    engines[2].crash()
    await group.check_health()
    engines[2].restart()  # back with its initial weights, version 0
    assert engines[2].weight_version == 0
    serving = await group.check_health()
    assert serving == [True, True, True] and pushed == [("e2", 1)]
    assert engines[2].weight_version == 1
    before = engines[2].calls
    outs = [await group.generate(req(3)) for _ in range(9)]
    assert engines[2].calls == before + 3  # it takes traffic again
    assert all(o[0].token_ids == echo_tokens(3, 4, 2) for o in outs)  # with the same weights


async def test_stale_engine_without_a_rejoin_path_gets_no_traffic():
    group, engines = group_of(2)
    await _push_bias(group, 1.0, 1)
    engines[0].crash()
    await group.check_health()
    engines[0].restart()
    assert await group.check_health() == [False, True]
    assert "no on_rejoin / weight_source" in group.member_stats()[0]["last_error"]
    for _ in range(4):
        out = await group.generate(req(3))
        assert out[0].weight_version == 1
    assert engines[0].served.total() == 0


async def test_engine_that_missed_a_push_rejoins_from_a_weight_source_directory(tmp_path):
    group, engines = group_of(2, weight_source=tmp_path, rejoin_transport="inproc")
    engines[1].crash()
    await group.check_health()
    sync = await connect_weight_sync([group], "inproc")  # engine 1 is down: not in the session
    assert engines[1].receivers == []
    weights = {"bias": torch.full((1, 4), 3.0)}
    save_file(weights, str(tmp_path / "model.safetensors"))  # the trainer keeps its latest weights here
    await sync.push(weights, version=5)
    await sync.close()
    engines[1].restart()
    assert await group.check_health() == [True, True]
    assert engines[1].weight_version == 5 and engines[1].offset() == 12
    outs = [await group.generate(req(1)) for _ in range(4)]
    assert {tuple(o[0].token_ids) for o in outs} == {tuple(echo_tokens(1, 12, 2))}


async def test_engine_rejoins_from_the_disk_transport_directory(tmp_path):
    group, engines = group_of(2, weight_source=tmp_path, rejoin_transport="inproc")
    engines[0].crash()
    await group.check_health()
    sync = await connect_weight_sync([group], "disk", options={"path": str(tmp_path)}, timeout_s=10)
    for version, value in ((1, 1.0), (2, 2.0)):  # the trainer pushes over disk; the directory keeps the newest
        await sync.push({"bias": torch.full((1, 4), value)}, version=version)
    await sync.close()
    engines[0].restart()
    assert await group.check_health() == [True, True]
    assert engines[0].weight_version == 2 and engines[0].offset() == 8


async def test_weight_source_at_another_version_is_refused(tmp_path):
    group, engines = group_of(2, weight_source=tmp_path, rejoin_transport="inproc")
    sync = await connect_weight_sync([group], "disk", options={"path": str(tmp_path)}, timeout_s=10)
    await sync.push({"bias": torch.ones(1, 4)}, version=1)
    await sync.close()
    engines[1].crash()
    await group.check_health()
    await _push_bias(group, 3.0, 2)  # over inproc: the directory still holds v1
    assert group.weight_version == 2
    engines[1].restart()
    assert await group.check_health() == [True, False]
    assert "holds v1, not the group's v2" in group.member_stats()[1]["last_error"]


async def test_push_fails_with_a_clear_error_when_a_session_member_died():
    group, engines = group_of(2)
    sync = await connect_weight_sync([group], "inproc", timeout_s=2)
    engines[0].crash()
    with pytest.raises(Exception, match="member 0"):
        await sync.push({"bias": torch.ones(1, 4)}, version=1)
    await sync.close()
    # reconnect: the new session has the healthy member only, and the push works
    sync = await connect_weight_sync([group], "inproc", timeout_s=2)
    await sync.push({"bias": torch.ones(1, 4)}, version=2)
    await sync.close()
    assert engines[1].weight_version == 2 and group.weight_version == 2


async def test_background_health_checks_mark_down_and_bring_back():
    group, engines = group_of(2, health_interval_s=0.02)
    await group.generate(req())  # starts the health loop
    engines[0].crash()
    for _ in range(100):
        await asyncio.sleep(0.02)
        if not group.member_stats()[0]["serving"]:
            break
    assert not group.member_stats()[0]["serving"]
    engines[0].restart()
    for _ in range(100):
        await asyncio.sleep(0.02)
        if group.member_stats()[0]["serving"]:
            break
    assert group.member_stats()[0]["serving"]
    await group.close()
    assert all(e.closed for e in engines)


async def test_detach_stops_the_group_and_leaves_its_engines_open():
    group, engines = group_of(2, health_interval_s=0.01)
    await group.generate(req())
    assert await group.detach() == engines
    assert group.closed and not any(e.closed for e in engines)
    calls = engines[0].calls
    engines[0].crash()
    await asyncio.sleep(0.05)  # no health loop any more: nothing notices
    assert group.member_stats()[0]["serving"] and engines[0].calls == calls
    with pytest.raises(EngineClosed):
        await group.generate(req())


async def test_added_engine_joins_at_the_group_version():
    async def on_rejoin(engine, version):
        await _push_bias(engine, 2.0, version)

    group, engines = group_of(1, on_rejoin=on_rejoin)
    await _push_bias(group, 2.0, 3)
    extra = EchoEngine("extra")
    index = await group.add_engine(extra)
    assert index == 1 and extra.weight_version == 3 and group.member_stats()[1]["serving"]
    with pytest.raises(ValueError, match="already a member"):
        await group.add_engine(extra)


async def test_replacement_takes_the_dead_members_place_and_sessions():
    async def on_rejoin(engine, version):
        await _push_bias(engine, 1.0, version)

    group, engines = group_of(2, routing="sticky", on_rejoin=on_rejoin)
    await _push_bias(group, 1.0, 4)
    for i in range(50):  # a session that member 0 owns
        mine = f"s{i}"
        await group.generate(req(tag=mine))
        if engines[0].served[mine]:
            break
    engines[0].crash()
    await group.generate(req(tag=mine))
    assert engines[1].served[mine] == 1  # moved while member 0 is down
    new = EchoEngine("new")
    await group.replace_engine(0, new)
    assert engines[0].closed and new.weight_version == 4
    out = await group.generate(req(5, tag=mine))
    assert new.served[mine] == 1 and out[0].token_ids == echo_tokens(5, 4, 2)  # the session is back on slot 0


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="at least one engine"):
        EngineGroup([])
    e = EchoEngine()
    with pytest.raises(ValueError, match="same engine object twice"):
        EngineGroup([e, e])
    with pytest.raises(ValueError, match="unknown routing 'random'"):
        EngineGroup([e], routing="random")  # type: ignore[arg-type]


def test_group_and_cli_listing_do_not_import_ray():
    import subprocess
    import sys

    code = (
        "import sys, rollout_engines, rollout_engines.group, rollout_engines.demo_group\n"
        "from rollout_engines.cli import main\n"
        "main(['backends', '--json'])\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.transformers
def test_demo_runs_on_a_local_group(tiny_model):
    from rollout_engines.demo_group import run_group_demo

    summary = run_group_demo("transformers", str(tiny_model), engines=2, use_ray=False, max_tokens=8)
    assert summary["backend"] == "transformers" and summary["engines"] == 2 and not summary["ray"]
    assert summary["outputs_changed"] and summary["restored_outputs_equal"] and summary["weight_version"] == 1
    assert summary["tokens_per_s"] > 0
    assert all(e["completed"] > 0 and e["weight_version"] == 2 for e in summary["per_engine"])


def test_router_benchmark_reports_its_numbers():
    from rollout_engines.bench import group as bench
    from rollout_engines.cli import build_parser

    args = build_parser("group").parse_args(["bench", "group", "--skip-scaling", "--requests", "2000", "--concurrency", "8"])
    out = bench.run(args)
    assert out["routed_per_s"] > 0 and out["routed_per_s_yielding"] > 0 and out["direct_per_s"] > 0
    assert len(out["spread"]) == 4 and min(out["spread"]) > 0  # every engine got requests


async def _until(check, what: str) -> None:
    for _ in range(2500):
        if check():
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"timed out waiting until {what}")


@pytest.mark.parametrize("call", ["generate", "stream"])
async def test_abort_while_the_group_checks_a_failed_members_health_reaches_the_retry(call: str):
    # Member 0 raises a generic error; the group checks its health (slow) before retrying the
    # request on member 1. An abort of the id in that window must end the retried request.
    broken, good = AbortableEcho("broken", delay_s=30.0), AbortableEcho("good", delay_s=30.0)
    broken.broken, broken.health_delay_s = True, 0.2
    group = EngineGroup([broken, good], routing="round_robin", health_interval_s=None)
    request = GenerateRequest(prompt_token_ids=[[3]], sampling=SamplingParams(max_tokens=2), request_ids=["r"])

    async def run() -> tuple[str | None, list[int]]:
        if call == "generate":
            out = (await group.generate(request))[0]
            return out.finish_reason, out.token_ids
        deltas = [d async for d in group.stream(request)]
        return deltas[-1].finish_reason, [t for d in deltas for t in d.token_ids]

    task = asyncio.ensure_future(run())
    await _until(lambda: broken.health_checks == 1, "the group checks member 0's health")
    await group.abort(["r"])
    assert await asyncio.wait_for(task, 5) == ("abort", [])
    assert good.aborted == ["r"] and group.retried == 1 and not group.member_stats()[0]["healthy"]
    assert group._owners == {} and not group._abort_on_arrival


async def test_a_bad_request_on_a_member_that_missed_a_push_fails_only_itself():
    # Member 1 joined after the weight sync connected, so a push leaves it healthy but stale (no
    # traffic until it catches up). A request it was running when the push came then raises an
    # error of its own: the request fails, the member is not marked down, nothing is retried.
    first, late = AbortableEcho("first"), AbortableEcho("late", delay_s=60.0)  # until release()
    first.late_poison = late.late_poison = True
    group = EngineGroup([first], routing="round_robin", health_interval_s=None)
    sync = await connect_weight_sync([group], "inproc")
    try:
        assert await group.add_engine(late) == 1
        await group.generate(req(3))  # round robin: member 0; the next goes to member 1
        bad = asyncio.ensure_future(group.generate(req(POISON)))
        await _until(lambda: late.concurrent == 1, "member 1 runs the bad request")
        await sync.push({"bias": torch.full((1, 4), 1.0)}, version=1)
        late.release()  # the bad request fails only now, after the push
    finally:
        await sync.close()
    assert group.member_stats()[1]["serving"] is False  # stale, still healthy
    with pytest.raises(RuntimeError, match="breaks the engine's code"):
        await asyncio.wait_for(bad, 5)
    assert first.calls == 1 and group.retried == 0  # not tried again on member 0
    stats = group.member_stats()[1]
    assert stats["healthy"] and stats["failures"] == 0, stats


@pytest.mark.skipif(sys.version_info < (3, 11), reason="a task counts its cancellations from Python 3.11")
@pytest.mark.parametrize("call", ["generate", "stream"])
async def test_a_caller_cancelling_while_its_member_goes_down_is_not_retried(call: str):
    slow, other = EchoEngine("slow", delay_s=30.0), EchoEngine("other")
    group = EngineGroup([slow, other], routing="round_robin", health_interval_s=None)

    async def run() -> object:
        if call == "generate":
            return await group.generate(req(3))
        return [d async for d in group.stream(req(3))]

    task = asyncio.ensure_future(run())
    await _until(lambda: slow.concurrent == 1, "member 0 runs it")
    task.cancel()  # the caller gives up ...
    slow.crash()  # ... and at the same moment member 0 dies and the group marks it down
    group._mark_down(group._members[0], "test: crashed")
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert other.calls == 0 and group.retried == 0  # not retried: the caller asked for nothing more
    assert (await group.info()).outstanding == 0 and group._owners == {}
