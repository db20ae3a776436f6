"""The shared backend logic (rollout_engines.backend_kit): the loop thread, the prompt rules and
the finish-reason mapping every backend uses."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from rollout_engines.backend_kit import LoopThread, finish_reason, validate_prompts
from rollout_engines.errors import InvalidRequest


# ---- LoopThread ------------------------------------------------------------------------------------
@pytest.fixture
def runner():
    loop = LoopThread("roe-test-loop")
    yield loop
    loop.close()


def test_runs_work_on_its_own_thread_and_loop(runner: LoopThread) -> None:
    async def where() -> tuple[str, asyncio.AbstractEventLoop]:
        await asyncio.sleep(0)
        return threading.current_thread().name, asyncio.get_running_loop()

    assert runner.run(where()) == ("roe-test-loop", runner.loop)
    # A function is called on the loop's thread (engine calls that must be made there).
    assert runner.run(lambda: where())[0] == "roe-test-loop"
    assert runner.submit(where()).result(5)[0] == "roe-test-loop"


def test_exceptions_reach_the_caller(runner: LoopThread) -> None:
    async def fail() -> None:
        raise KeyError("from the loop")

    with pytest.raises(KeyError, match="from the loop"):
        runner.run(fail())
    with pytest.raises(KeyError, match="from the loop"):
        asyncio.run(runner.call(fail))
    assert runner.run(asyncio.sleep(0, result=3)) == 3  # the loop survives a failure


def test_waits_are_bounded_and_the_late_work_is_cancelled(runner: LoopThread) -> None:
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="longer than 0.2 s"):
        runner.run(forever(), timeout=0.2)
    assert time.monotonic() - start < 5
    assert cancelled.wait(5)

    async def own_timeout() -> None:  # the work's own TimeoutError is not mistaken for the wait's
        raise TimeoutError("inner")

    with pytest.raises(TimeoutError, match="inner"):
        runner.run(own_timeout(), timeout=5)


def test_call_from_another_loop_and_from_its_own(runner: LoopThread) -> None:
    async def name() -> str:
        return threading.current_thread().name

    async def caller() -> tuple[str, str]:
        outer = await runner.call(name)
        inner = await runner.call(lambda: runner.call(name))  # awaited directly on its own loop
        return outer, inner

    assert asyncio.run(caller()) == ("roe-test-loop", "roe-test-loop")


def test_cancelling_the_caller_cancels_the_work(runner: LoopThread) -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def caller() -> None:
        task = asyncio.ensure_future(runner.call(forever))
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(caller())
    assert cancelled.wait(5)


def test_close_stops_the_thread_and_is_idempotent() -> None:
    runner = LoopThread("roe-test-close")
    thread = runner.thread
    runner.run(asyncio.sleep(0))
    runner.close()
    assert not thread.is_alive() and runner.loop.is_closed() and runner.closed
    runner.close()
    with pytest.raises(RuntimeError, match="is closed"):
        runner.run(asyncio.sleep(0))


def test_run_on_its_own_thread_is_refused(runner: LoopThread) -> None:
    async def reenter() -> None:
        runner.run(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="await LoopThread.call instead"):
        runner.run(reenter())


# ---- validate_prompts --------------------------------------------------------------------------------
def test_the_context_window_holds_prompt_plus_max_tokens_exactly() -> None:
    validate_prompts([[1] * 6], max_tokens=2, max_model_len=8)  # 6 + 2 == 8: fits
    with pytest.raises(InvalidRequest, match="6 prompt tokens \\+ max_tokens 3 = 9 exceed the context window of 8") as err:
        validate_prompts([[1] * 6], max_tokens=3, max_model_len=8)
    assert "lower max_tokens (at most 2 here)" in str(err.value)
    assert isinstance(err.value, ValueError)  # callers may catch ValueError
    validate_prompts([[1] * 10_000], max_tokens=10**6, max_model_len=None)  # window unknown: not checked


def test_continued_tokens_count_toward_the_window() -> None:
    validate_prompts([[1, 2], [3]], max_tokens=3, max_model_len=8, continued=[[4, 5, 6], None])
    with pytest.raises(InvalidRequest, match="prompt 0: 2 prompt tokens \\+ 4 tokens it continues \\+ max_tokens 3"):
        validate_prompts([[1, 2], [3]], max_tokens=3, max_model_len=8, continued=[[4, 5, 6, 7], None])
    with pytest.raises(InvalidRequest, match="continue_from\\[1\\] has token id 99"):
        validate_prompts([[1], [2]], max_tokens=1, max_model_len=None, vocab_size=10, continued=[[], [99]])


def test_empty_prompts_and_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="prompt 1 has no tokens"):
        validate_prompts([[1], []], max_tokens=1, max_model_len=8)
    validate_prompts([[0, 9]], max_tokens=1, max_model_len=None, vocab_size=10)
    with pytest.raises(InvalidRequest, match="prompt 0 has token id 10 outside the model's vocabulary \\(size 10\\)"):
        validate_prompts([[0, 10, 3]], max_tokens=1, max_model_len=None, vocab_size=10)
    with pytest.raises(InvalidRequest, match="token id -1"):
        validate_prompts([[-1]], max_tokens=1, max_model_len=None, vocab_size=10)
    validate_prompts([[10**9]], max_tokens=1, max_model_len=None)  # vocabulary unknown: not checked


# ---- finish reasons -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reason", "expected"),
    [("stop", "stop"), ("length", "length"), ("abort", "abort"), (None, "abort"), ("error", "abort"),
     ({"type": "length", "length": 4}, "length"), ({"type": "stop", "matched": 2}, "stop"), ({}, "abort")],
)
def test_finish_reasons_map_onto_the_cores(reason, expected) -> None:
    assert finish_reason(reason) == expected


def test_prefix_cache_tracker_skips_only_resets_that_cannot_matter() -> None:
    from rollout_engines.backend_kit import PrefixCacheTracker

    cache = PrefixCacheTracker()
    first = cache.dirty()
    assert first is not None  # never reset: the state is unknown, reset
    cache.reset_done(first)
    assert cache.dirty() is None  # nothing submitted since: skip
    cache.submitted()
    token = cache.dirty()
    assert token is not None
    cache.submitted()  # a request submitted while the reset ran
    cache.reset_done(token)
    assert cache.dirty() is not None  # that request may have cached blocks: the next reset runs
    cache.reset_done(cache.dirty() or 0)
    assert cache.dirty() is None
    cache.forget()  # memory released and restored
    assert cache.dirty() is not None


def test_options_passed_on_must_be_the_librarys_arguments_and_not_the_backends_own() -> None:
    import dataclasses

    from rollout_engines.backend_kit import check_passed_options

    @dataclasses.dataclass
    class Args:
        gpu_memory_utilization: float = 0.9
        seed: int = 0

    def check(extra: dict) -> None:
        check_passed_options(extra, Args, library="Args", own=["enforce_eager"], set_here={"seed": "EngineConfig.seed"})

    check({"gpu_memory_utilization": 0.5})
    with pytest.raises(ValueError, match="unknown option 'gpu_memory_utilisation'.*did you mean 'gpu_memory_utilization'"):
        check({"gpu_memory_utilisation": 0.5})
    with pytest.raises(ValueError, match="'enforce_eagre'.*did you mean 'enforce_eager'"):
        check({"enforce_eagre": True})
    with pytest.raises(ValueError, match="'seed' is set by rollout-engines; use EngineConfig.seed"):
        check({"seed": 3})
    check_passed_options({"anything": 1}, None, library="Args", own=(), set_here={})  # no dataclass: not checked
