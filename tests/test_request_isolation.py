"""One request's values, size or cancellation never fail or hold up the requests batched with it.

On the embedded `transformers` engine: a request that cannot run fails alone (its sampling state
and prompts are built before it joins a batch), a top_k above the vocabulary is clamped, text is
tokenized off the worker, stop strings cost bounded work per step, and a cancelled request stops
generating while the rest of its batch carries on.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from rollout_engines import GenerateRequest, InvalidRequest, SamplingParams
from rollout_engines.backends.transformers import engine as engine_module
from rollout_engines.backends.transformers import generation
from rollout_engines.backends.transformers.engine import TransformersEngine
from rollout_engines.backends.transformers.generation import StopStrings

pytestmark = pytest.mark.transformers

PROMPT = "The quick brown fox"
PATIENCE_S = 30  # "promptly": generous, for a busy machine


def greedy(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture
def merged(engine: TransformersEngine, wait_until: Callable[..., Any]) -> Callable[..., Awaitable[list[Any]]]:
    """``await merged(*calls)``: run the calls as one merged batch of ``engine`` (its worker is held
    until all are queued); their results or errors."""

    async def run(*calls: Awaitable[Any]) -> list[Any]:
        gate = threading.Event()
        blocker = asyncio.ensure_future(engine._call(gate.wait))
        tasks = [asyncio.ensure_future(c) for c in calls]

        def settled() -> int:  # queued behind the held worker, or already failed before queuing
            return sum(isinstance(j, engine_module._GenerateJob) for j in list(engine._jobs)) + sum(t.done() for t in tasks)

        await wait_until(lambda: settled() >= len(calls), "every request is queued")
        gate.set()
        await blocker
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), PATIENCE_S)

    return run


def innocent(i: int) -> GenerateRequest:
    return GenerateRequest(prompts=[f"{PROMPT} {i}"], sampling=greedy(6, ignore_eos=True))


# ---- one bad request fails alone ------------------------------------------------------------------
async def test_a_prompt_outside_the_vocabulary_fails_alone(engine: TransformersEngine, merged: Callable[..., Any]) -> None:
    alone = [await engine.generate(innocent(i)) for i in range(10)]
    batches = engine.batches_run
    bad = GenerateRequest(prompt_token_ids=[[1, engine.vocab_size + 7]], sampling=greedy(6))  # passes validation
    results = await merged(*(engine.generate(innocent(i)) for i in range(5)), engine.generate(bad),
                           *(engine.generate(innocent(i)) for i in range(5, 10)))
    assert isinstance(results[5], InvalidRequest) and "outside the model's vocabulary" in str(results[5])
    good = results[:5] + results[6:]
    assert [[c.token_ids for c in r] for r in good] == [[c.token_ids for c in r] for r in alone]
    assert engine.batches_run == batches + 1, "the ten innocent requests should have run as one batch"


async def test_top_k_above_the_vocabulary_is_clamped(engine: TransformersEngine, merged: Callable[..., Any]) -> None:
    def sampled(top_k: int) -> GenerateRequest:
        s = SamplingParams(temperature=1.0, top_k=top_k, seed=11, max_tokens=8, ignore_eos=True)
        return GenerateRequest(prompts=[PROMPT], sampling=s)

    # Bypassing validation (a value past MAX_TOP_K that pydantic would refuse): clamped all the same.
    huge = sampled(-1)
    huge.sampling = SamplingParams.model_construct(**{**huge.sampling.model_dump(), "top_k": 2**64})
    results = await merged(*(engine.generate(innocent(i)) for i in range(10)),
                           engine.generate(sampled(2**31 - 1)), engine.generate(huge))
    assert not [r for r in results if isinstance(r, BaseException)], results
    disabled = await engine.generate(sampled(-1))
    assert results[10][0].token_ids == results[11][0].token_ids == disabled[0].token_ids


async def test_sampling_values_that_cannot_be_used_fail_alone(engine: TransformersEngine, merged: Callable[..., Any]) -> None:
    bad = GenerateRequest(prompts=[PROMPT], sampling=greedy(6))
    bad.sampling = SamplingParams.model_construct(**{**bad.sampling.model_dump(), "temperature": float("nan")})
    results = await merged(engine.generate(innocent(0)), engine.generate(bad), engine.generate(innocent(1)))
    assert isinstance(results[1], InvalidRequest) and "sampling.temperature" in str(results[1])
    assert all(len(r[0].token_ids) == 6 for r in (results[0], results[2]))


async def test_a_row_failing_during_the_batch_ends_only_its_request(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch, merged: Callable[..., Any]
) -> None:
    real_step = StopStrings.step

    def step(self: StopStrings, tokens: list[int], tokenizer: Any) -> int | None:
        if "BOOM" in self.stops and len(tokens) == 3:
            raise RuntimeError("decoding failed for this row")
        return real_step(self, tokens, tokenizer)

    monkeypatch.setattr(StopStrings, "step", step)
    bad = GenerateRequest(prompts=[PROMPT], sampling=greedy(16, ignore_eos=True, stop=["BOOM"]))
    results = await merged(engine.generate(innocent(0)), engine.generate(bad), engine.generate(innocent(1)))
    assert isinstance(results[1], RuntimeError) and "decoding failed" in str(results[1])
    assert all(len(r[0].token_ids) == 6 and r[0].finish_reason == "length" for r in (results[0], results[2]))


async def test_a_merged_batch_that_fails_is_retried_request_by_request(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch, merged: Callable[..., Any]
) -> None:
    real = engine_module.run_batch

    def run_batch(model: Any, tokenizer: Any, rows: list[generation.Row], **kw: Any) -> None:
        if any(r.params.seed == 666 for r in rows):
            raise ValueError("this batch cannot run")
        real(model, tokenizer, rows, **kw)

    monkeypatch.setattr(engine_module, "run_batch", run_batch)
    bad = GenerateRequest(prompts=[PROMPT], sampling=SamplingParams(seed=666, max_tokens=4))
    results = await merged(*(engine.generate(innocent(i)) for i in range(3)), engine.generate(bad))
    assert isinstance(results[3], ValueError)
    assert all(len(r[0].token_ids) == 6 for r in results[:3])


# ---- size: refused at the edge, or kept off the worker --------------------------------------------
def test_too_many_stop_strings_and_too_long_a_prompt_are_refused_at_the_edge() -> None:
    with pytest.raises(ValidationError, match="MAX_STOP_STRINGS"):
        GenerateRequest(prompts=[PROMPT], sampling=SamplingParams(stop=[f"s{i}" for i in range(100_000)]))
    with pytest.raises(ValidationError, match="MAX_PROMPT_CHARS"):
        GenerateRequest(prompts=["x" * (16 * 2**20)])


async def test_a_large_prompt_is_tokenized_off_the_worker(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch, wait_until: Callable[..., Any]
) -> None:
    """While a large text prompt is being tokenized, other requests are generated."""
    release = threading.Event()
    tokenizing = threading.Event()
    real = engine._tokenize

    def tokenize(request: GenerateRequest) -> list[list[int]]:
        if request.prompts and len(request.prompts[0]) > 20_000:
            tokenizing.set()
            assert release.wait(PATIENCE_S)  # held until the small request is done
        return real(request)

    monkeypatch.setattr(engine, "_tokenize", tokenize)
    large = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=["hello world " * 5000], sampling=greedy(4))))
    await wait_until(tokenizing.is_set, "the large prompt is being tokenized")
    small = await asyncio.wait_for(engine.generate(innocent(0)), PATIENCE_S)
    assert len(small[0].token_ids) == 6
    release.set()
    with pytest.raises(InvalidRequest, match="context window"):  # ~10k tokens for a 2048-token window
        await asyncio.wait_for(large, PATIENCE_S)


# ---- stop strings: same answer as searching the whole text, bounded work per step ----------------
def test_stop_strings_found_incrementally_as_in_the_whole_text(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        tokens = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        full = tok.decode(tokens, skip_special_tokens=True)
        if len(full) < 3:
            continue
        starts = [rng.randrange(len(full)) for _ in range(rng.randint(1, 3))]
        stops = [s for s in (full[a:a + rng.randint(1, 6)] for a in starts) if "\ufffd" not in s] + ["\x00never"]
        expected = None
        for k in range(1, len(tokens) + 1):
            text = tok.decode(tokens[:k], skip_special_tokens=True)
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits:
                expected = (k, min(hits))
                break
        found, checker = None, StopStrings(stops)
        for k in range(1, len(tokens) + 1):
            cut = checker.step(tokens[:k], tok)
            if cut is not None:
                found = (k, cut)
                break
        assert found == expected, (tokens, stops)
        checked += 1
    assert checked > 200


async def test_stop_string_work_per_step_is_bounded(engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []
    real_decode = engine.tokenizer.decode

    def decode(ids: Any, **kw: Any) -> str:
        decoded.append(len(ids))
        return real_decode(ids, **kw)

    monkeypatch.setattr(engine.tokenizer, "decode", decode)
    stops = [f"\x00{i}" for i in range(128)]  # never produced: every step searches
    out = await engine.generate(GenerateRequest(prompts=[PROMPT], sampling=greedy(400, ignore_eos=True, stop=stops)))
    assert len(out[0].token_ids) == 400 and out[0].finish_reason == "length"
    per_step = decoded[:-1]  # the last one decodes the completion's text once
    assert len(per_step) >= 400 and max(per_step) <= 2 * generation._MAX_PENDING_TOKENS


# ---- cancellation ---------------------------------------------------------------------------------
def _room(engine: TransformersEngine) -> int:
    """The most tokens PROMPT leaves room for in the context window: a request that runs until
    it is cancelled."""
    return engine.max_model_len - len(engine.tokenizer(PROMPT)["input_ids"])


async def test_cancelling_a_running_request_stops_it_and_spares_its_batch(engine: TransformersEngine, wait_until: Callable[..., Any]) -> None:
    short = GenerateRequest(prompts=["Once"], sampling=greedy(24, ignore_eos=True))
    alone = await engine.generate(short)
    long = GenerateRequest(prompts=[PROMPT], sampling=SamplingParams(max_tokens=_room(engine), ignore_eos=True, n=4))
    gate = threading.Event()
    blocker = asyncio.ensure_future(engine._call(gate.wait))
    long_task = asyncio.ensure_future(engine.generate(long))
    short_task = asyncio.ensure_future(engine.generate(short))
    await wait_until(lambda: sum(isinstance(j, engine_module._GenerateJob) for j in list(engine._jobs)) == 2,
                     "both requests are queued")
    gate.set()
    await blocker
    await wait_until(lambda: engine._extra_info()["running"] == 2, "both requests run in one batch")
    long_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long_task
    merged_short = await asyncio.wait_for(short_task, PATIENCE_S)
    assert [c.token_ids for c in merged_short] == [c.token_ids for c in alone]
    after = await asyncio.wait_for(engine.generate(short), PATIENCE_S)
    assert [c.token_ids for c in after] == [c.token_ids for c in alone]
    info = await engine.info()
    assert info.outstanding == 0 and info.extra["running"] == 0 and info.extra["queued"] == 0
    assert info.extra["requests_cancelled"] == 1


async def test_cancelling_a_queued_request_removes_it(engine: TransformersEngine, wait_until: Callable[..., Any]) -> None:
    gate = threading.Event()
    blocker = asyncio.ensure_future(engine._call(gate.wait))
    long_task = asyncio.ensure_future(engine.generate(
        GenerateRequest(prompts=[PROMPT], sampling=SamplingParams(max_tokens=_room(engine), ignore_eos=True))))
    await wait_until(lambda: any(isinstance(j, engine_module._GenerateJob) for j in list(engine._jobs)),
                     "the request is queued")
    long_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long_task
    info = await engine.info()
    assert info.extra["queued"] == 0 and info.extra["requests_cancelled"] == 1 and info.outstanding == 0
    gate.set()
    await blocker
    out = await asyncio.wait_for(engine.generate(innocent(0)), PATIENCE_S)
    assert len(out[0].token_ids) == 6
    assert (await engine.info()).extra["running"] == 0
