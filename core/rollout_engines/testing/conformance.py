"""The conformance suite: the executable definition of what "a backend" is.

A backend's test file is one subclass that says how to build its engine::

    import pytest
    from rollout_engines import EngineConfig
    from rollout_engines.testing.conformance import BackendConformance

    @pytest.mark.mybackend
    class TestMyBackend(BackendConformance):
        @pytest.fixture(scope="class")
        @classmethod
        def engine_config(cls, tiny_model):
            return EngineConfig(backend="mybackend", model=str(tiny_model))

(or override ``make_engine`` with a class-scoped fixture returning a zero-argument callable that
returns an :class:`Engine`). ``rollout-engines check --backend NAME`` runs the same suite through
:func:`run_conformance`.

Rules of the suite:

- **Capability-gated, never name-gated**: a test skips only because the engine does not declare a
  capability (``engine.capabilities``), and says which.
- **One engine per class**: engines are expensive (vLLM starts in ~15 s), so one is created per
  class and driven from synchronous tests through a private event-loop thread (no pytest-asyncio
  loop-scope traps). A test that closes it gets a fresh one for the tests after it, so two engines
  of the class never coexist (one sleep-mode engine per process, vllm#18975).
- **No silent opt-outs**: a subclass that overrides a standard test must mark the override
  ``@pytest.mark.xfail(reason=...)``; anything else is an error when the class is defined.
- The model's original weights (to perturb and push back) are read from the safetensors files in
  the engine's model directory, so the suite needs nothing from the backend beyond the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
import tempfile
import textwrap
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest

from ..backend_kit import LoopThread
from ..engine import EngineProtocol
from ..errors import (
    CapabilityError,
    EngineAsleep,
    EngineClosed,
    InvalidRequest,
    ManifestMismatch,
    StaleVersion,
    WeightsInvalidated,
    WeightSyncError,
)
from ..tokenization import chat_token_ids
from ..types import ChatMessage, Completion, EngineConfig, GenerateRequest, SamplingParams

T = TypeVar("T")

#: Transports the suite pushes through, most direct first; the first one the engine declares wins.
PREFERRED_TRANSPORTS = ("inproc", "shm", "gloo", "disk", "http")
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time there was a"]
CALL_TIMEOUT_S = float(os.environ.get("ROLLOUT_ENGINES_CONFORMANCE_TIMEOUT", "300"))
#: How long an aborted request may take to come back ("promptly").
ABORT_PATIENCE_S = 5.0


class EngineSlot:
    """Holds the class's engine and a private event loop that drives it from sync tests."""

    def __init__(self, factory: Callable[[], EngineProtocol | Awaitable[EngineProtocol]]) -> None:
        self._factory = factory
        self._engine: EngineProtocol | None = None
        self._loop_thread = LoopThread("roe-conformance")
        self.loop = self._loop_thread.loop

    def run(self, coro: Coroutine[Any, Any, T] | Awaitable[T], timeout: float = CALL_TIMEOUT_S) -> T:
        """Run ``coro`` on the slot's loop; past ``timeout`` seconds it is cancelled (TimeoutError)."""
        return self._loop_thread.run(coro, timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``coro`` on the loop without waiting; returns a concurrent future."""
        return self._loop_thread.submit(coro)

    @property
    def engine(self) -> EngineProtocol:
        if self._engine is None or self._engine.closed:
            # Called on the test's (main) thread, so a backend can install what only the main thread
            # may (signal handlers); an async factory is awaited on the slot's loop.
            made = self._factory()
            if asyncio.iscoroutine(made) or isinstance(made, asyncio.Future):
                awaitable = made

                async def create() -> Any:
                    return await awaitable

                made = self.run(create())
            assert isinstance(made, EngineProtocol), f"make_engine returned {type(made).__name__}, not an engine"
            self._engine = made
        return self._engine

    def discard(self) -> None:
        """Forget the engine (after a test closed it); the next use creates a fresh one."""
        if self._engine is not None and not self._engine.closed:
            self.run(self._engine.close())
        self._engine = None

    def close(self) -> None:
        try:
            self.discard()
        finally:
            self._loop_thread.close()


# ---- helpers ----------------------------------------------------------------------------------
def need(engine: EngineProtocol, flag: str, why: str = "") -> None:
    """Skip unless the engine declares capability ``flag`` (truthy)."""
    if not getattr(engine.capabilities, flag):
        pytest.skip(f"backend '{engine.backend_name}' does not declare capability '{flag}'{why}")


def seed_if_declared(engine: EngineProtocol, seed: int) -> int | None:
    """``seed`` where the engine honours per-request seeds; None where it would refuse them."""
    return seed if engine.capabilities.seed else None


def pick_transport(engine: EngineProtocol) -> str:
    for name in PREFERRED_TRANSPORTS:
        if name in engine.capabilities.transports:
            return name
    if engine.capabilities.transports:
        return engine.capabilities.transports[0]
    pytest.skip(f"backend '{engine.backend_name}' declares no weight transport")
    raise AssertionError  # unreachable


def greedy(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _no_replacement(text: str) -> str:
    # Incremental detokenizers may hold back or render an incomplete UTF-8 tail differently.
    return text.replace("\ufffd", "")


def tokens_of(outs: list[Completion]) -> list[list[int]]:
    return [c.token_ids for c in outs]


def _has_mismatch(exc: BaseException) -> bool:
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ManifestMismatch):
            return True
        stack += [e.__cause__, e.__context__]
        stack += [f[1] for f in getattr(e, "failures", []) if isinstance(f, tuple) and len(f) == 2]
    return False


# ---- the base ---------------------------------------------------------------------------------
class ConformanceBase:
    """Fixtures and the override guard shared by every part of the suite."""

    _standard_tests: ClassVar[set[str]] = set()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        standard = ConformanceBase._standard_tests
        if cls.__module__ == __name__:
            standard.update(n for n in cls.__dict__ if n.startswith("test_"))
            return
        for name, value in cls.__dict__.items():
            if name in standard:
                marks = getattr(value, "pytestmark", [])
                if not any(m.name == "xfail" and m.kwargs.get("reason") for m in marks):
                    raise TypeError(
                        f"{cls.__qualname__}.{name} overrides a standard conformance test; mark the override "
                        "@pytest.mark.xfail(reason='why this backend differs') so the gap stays visible"
                    )

    # Backends provide `engine_config` (class scope) or override `make_engine`.
    @pytest.fixture(scope="class")
    @classmethod
    def make_engine(cls, request: pytest.FixtureRequest) -> Callable[[], EngineProtocol]:
        try:
            config: EngineConfig = request.getfixturevalue("engine_config")
        except pytest.FixtureLookupError:
            raise TypeError(
                f"{cls.__name__} must provide a class-scoped "
                "fixture 'engine_config' (an EngineConfig) or 'make_engine' (a callable returning an Engine)"
            ) from None

        def make() -> EngineProtocol:
            from ..factory import create_engine

            return create_engine(config)

        return make

    @pytest.fixture(scope="class")
    @classmethod
    def slot(cls, make_engine: Callable[[], EngineProtocol]) -> Any:
        s = EngineSlot(make_engine)
        yield s
        s.close()

    @pytest.fixture
    def engine(self, slot: EngineSlot) -> EngineProtocol:
        return slot.engine

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, slot: EngineSlot) -> str:
        """Local directory with the model's tokenizer and safetensors (the engine's ``config.model``)."""
        path = slot.engine.config.model
        if not Path(path).is_dir():
            pytest.skip(f"the engine's model '{path}' is not a local directory; override the 'model_path' fixture")
        return path

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, slot: EngineSlot, model_path: str) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(slot.engine.config.tokenizer or model_path)

    @pytest.fixture(scope="class")
    @classmethod
    def prompt_ids(cls, tokenizer: Any) -> list[list[int]]:
        return [tokenizer(p)["input_ids"] for p in PROMPTS]

    @pytest.fixture(scope="class")
    @classmethod
    def original_weights(cls, model_path: str, engine_config: EngineConfig) -> dict[str, Any]:
        """The checkpoint in the dtype the engine runs in (what a trainer would send it)."""
        from ..weights.buckets import torch_dtype
        from ..weights.checkpoint import load_checkpoint

        dtype = engine_config.dtype
        return load_checkpoint(model_path, None if dtype in (None, "auto") else torch_dtype(dtype))

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, slot: EngineSlot, prompt_ids: list[list[int]]) -> list[list[int]]:
        """Greedy tokens of the fresh engine (original weights), 8 per prompt."""
        outs = slot.run(slot.engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(8))))
        return tokens_of(outs)

    # -- helpers for tests --
    def greedy_tokens(self, slot: EngineSlot, prompt_ids: list[list[int]]) -> list[list[int]]:
        return tokens_of(slot.run(slot.engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(8)))))

    def push(self, slot: EngineSlot, tensors: dict[str, Any], version: int) -> int:
        from ..weights.session import connect_weight_sync

        engine = slot.engine

        async def go() -> int:
            sync = await connect_weight_sync([engine], pick_transport(engine), timeout_s=120)
            try:
                return await sync.push(tensors, version=version)
            finally:
                await sync.close()

        return slot.run(go())

    @contextlib.contextmanager
    def restoring(self, slot: EngineSlot, original_weights: dict[str, Any]) -> Iterator[None]:
        """For a test that pushes other weights and pushes the originals back at its end: when it
        fails before that, the originals are pushed back here, so the tests after it (which share
        the engine) compare against the model they expect."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.push(slot, original_weights, slot.engine.weight_version + 1)
            raise


# ---- generation semantics ---------------------------------------------------------------------
class GenerationTests(ConformanceBase):
    def test_token_ids_in_completions_out(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(5))))
        assert [c.prompt_index for c in outs] == list(range(len(prompt_ids)))
        assert all(c.sample_index == 0 for c in outs)
        for c, p in zip(outs, prompt_ids, strict=True):
            assert c.prompt_token_ids in ([], p)
            assert len(c.token_ids) == 5
            assert c.finish_reason == "length"
            assert c.logprobs is None
            assert c.weight_version == engine.weight_version

    def test_text_prompts_match_token_prompts(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        by_text = slot.run(engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(6))))
        by_ids = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(6))))
        assert tokens_of(by_text) == tokens_of(by_ids)
        assert all(isinstance(c.text, str) for c in by_text)

    def test_text_decodes_token_ids(self, slot: EngineSlot, engine: EngineProtocol, tokenizer: Any, prompt_ids: list[list[int]]) -> None:
        outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(12))))
        for c in outs:
            decoded = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert _no_replacement(c.text) == _no_replacement(decoded)

    @pytest.mark.parametrize("max_tokens", [1, 7])
    def test_max_tokens_respected(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], max_tokens: int) -> None:
        fixed = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(max_tokens))))
        assert [len(c.token_ids) for c in fixed] == [max_tokens] * len(prompt_ids)
        free = slot.run(engine.generate(GenerateRequest(
            prompt_token_ids=prompt_ids, sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed_if_declared(engine, 3)))))
        for c in free:
            assert 1 <= len(c.token_ids) <= max_tokens
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.token_ids) == max_tokens

    def test_batch_times_n_prompt_major(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        need(engine, "n")
        s = SamplingParams(temperature=1.0, max_tokens=6, n=3, ignore_eos=True)
        outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids[:2], sampling=s)))
        assert [(c.prompt_index, c.sample_index) for c in outs] == [(i, j) for i in range(2) for j in range(3)]
        assert all(len(c.token_ids) == 6 for c in outs)
        # Sampling at temperature 1 from a 4k-token vocabulary: three samples are not all equal.
        for i in range(2):
            assert len({tuple(c.token_ids) for c in outs if c.prompt_index == i}) > 1

    def test_greedy_is_deterministic(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
        again = self.greedy_tokens(slot, prompt_ids)
        assert again == reference
        alone = tokens_of(slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids[1:2], sampling=greedy(8)))))
        assert alone == reference[1:2], "a prompt's greedy tokens must not depend on its batch"

    def test_seeded_sampling_is_reproducible(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        need(engine, "seed")

        def run(seed: int) -> list[list[int]]:
            s = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=seed, ignore_eos=True)
            return tokens_of(slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=s))))

        first, second, other = run(1234), run(1234), run(4321)
        assert first == second
        assert first != other

    def test_sampling_params_shape_the_distribution(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
        # top_k=1 (or a tiny top_p, or min_p=1) leaves only the most likely token: greedy, whatever the temperature.
        for extra in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
            s = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, seed=seed_if_declared(engine, 7), **extra)
            outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=s)))
            assert tokens_of(outs) == reference, f"{extra} should reduce sampling to greedy"

    def test_stop_string(self, slot: EngineSlot, engine: EngineProtocol, tokenizer: Any, prompt_ids: list[list[int]]) -> None:
        need(engine, "stop_strings")
        ref = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids[:1], sampling=greedy(16))))[0]
        text = ref.text
        start = next((k for k in range(max(1, len(text) // 3), len(text) - 2)
                      if text[k:k + 2].strip() and "\ufffd" not in text[k:k + 2]), None)
        if start is None:
            pytest.skip("the reference output has no usable stop string")
        stop = text[start:start + 2]
        cut = text.find(stop)
        out = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids[:1], sampling=greedy(16, stop=[stop]))))[0]
        assert out.finish_reason == "stop"
        assert stop not in out.text
        assert _no_replacement(out.text) == _no_replacement(text[:cut])
        assert out.token_ids == ref.token_ids[: len(out.token_ids)]
        assert len(out.token_ids) < len(ref.token_ids)

    def test_stop_token_ids(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
        stop_id = reference[0][3]
        first = reference[0].index(stop_id)
        out = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids[:1], sampling=greedy(8, stop_token_ids=[stop_id]))))[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == reference[0][: first + 1]

    def test_logprobs_of_sampled_tokens(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        need(engine, "logprobs")
        s = SamplingParams(temperature=1.0, max_tokens=6, logprobs=1, seed=seed_if_declared(engine, 11))
        outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=s)))
        for c in outs:
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 1e-4 and lp > -1e4 for lp in c.logprobs)
        g = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(4, logprobs=0))))
        g2 = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(4, logprobs=0))))
        for a, b in zip(g, g2, strict=True):
            assert a.logprobs is not None and b.logprobs is not None
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
        plain = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(4))))
        assert all(c.logprobs is None for c in plain)

    def test_chat(self, slot: EngineSlot, engine: EngineProtocol, tokenizer: Any) -> None:
        need(engine, "chat")
        chats = [[ChatMessage(role="user", content="Say hello")],
                 [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Count to three")]]
        outs = slot.run(engine.chat(GenerateRequest(messages=chats, sampling=greedy(6))))
        assert [c.prompt_index for c in outs] == [0, 1]
        for c, chat in zip(outs, chats, strict=True):
            ids = chat_token_ids(tokenizer, chat)
            assert c.prompt_token_ids in ([], ids)
            assert len(c.token_ids) == 6
        first = chat_token_ids(tokenizer, chats[0])
        direct = slot.run(engine.generate(GenerateRequest(prompt_token_ids=[first], sampling=greedy(6))))
        assert direct[0].token_ids == outs[0].token_ids

    def test_bad_requests_raise_typed_errors(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
        from pydantic import ValidationError

        with pytest.raises(ValidationError, match="max_tokens"):
            SamplingParams(max_tokens=0)
        with pytest.raises(ValidationError, match="top_p"):
            SamplingParams(top_p=0.0)
        with pytest.raises(ValidationError, match="empty batch"):
            GenerateRequest(prompt_token_ids=[])
        with pytest.raises(ValidationError, match="exactly one"):
            GenerateRequest(prompt_token_ids=[[1]], prompts=["x"])
        with pytest.raises(ValueError):  # a token id outside the vocabulary
            slot.run(engine.generate(GenerateRequest(prompt_token_ids=[[10**9]], sampling=greedy(2))))
        with pytest.raises(ValueError):  # a prompt longer than any context window here
            too_long = prompt_ids[0] * (100_000 // len(prompt_ids[0]) + 1)
            slot.run(engine.generate(GenerateRequest(prompt_token_ids=[too_long], sampling=greedy(2))))
        assert self.greedy_tokens(slot, prompt_ids) == reference, "a rejected request must not disturb the engine"

    def test_info_and_health(self, slot: EngineSlot, engine: EngineProtocol) -> None:
        info = slot.run(engine.info())
        assert info.backend == engine.backend_name
        assert info.model == engine.config.model
        assert info.weight_version == engine.weight_version
        assert info.asleep == [] and info.paused is False and info.healthy is True
        assert info.capabilities == engine.capabilities.model_dump()
        assert slot.run(engine.health()) is True


# ---- sleep / wake -----------------------------------------------------------------------------
class SleepTests(ConformanceBase):
    def test_sleep_unsupported_is_a_capability_error(self, slot: EngineSlot, engine: EngineProtocol) -> None:
        if engine.capabilities.supports_sleep():
            pytest.skip("backend declares sleep support")
        with pytest.raises(CapabilityError):
            slot.run(engine.sleep())

    def test_sleep_wake_keeps_outputs(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]], original_weights: dict[str, Any]) -> None:
        need(engine, "sleep_levels")
        level = min(engine.capabilities.sleep_levels)
        slot.run(engine.sleep(level=level))
        assert slot.run(engine.info()).asleep
        with pytest.raises(EngineAsleep):
            slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(2))))
        slot.run(engine.wake_up())
        assert slot.run(engine.info()).asleep == []
        if level >= 2 or not engine.capabilities.weights_kept_on_sleep:
            with pytest.raises(WeightsInvalidated):
                slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(2))))
            self.push(slot, original_weights, engine.weight_version + 1)
        assert self.greedy_tokens(slot, prompt_ids) == reference

    def test_sleep_kv_cache_only(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
        need(engine, "sleep_levels")
        if "kv_cache" not in engine.capabilities.sleep_tags:
            pytest.skip("backend does not declare the 'kv_cache' sleep tag")
        slot.run(engine.sleep(level=min(engine.capabilities.sleep_levels), tags=["kv_cache"]))
        with pytest.raises(EngineAsleep):
            slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(2))))
        slot.run(engine.wake_up(tags=["kv_cache"]))
        assert self.greedy_tokens(slot, prompt_ids) == reference

    def test_discarded_weights_need_a_push(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]], original_weights: dict[str, Any]) -> None:
        need(engine, "sleep_levels")
        caps = engine.capabilities
        level = 2 if 2 in caps.sleep_levels else (min(caps.sleep_levels) if not caps.weights_kept_on_sleep else None)
        if level is None:
            pytest.skip("backend keeps weights on sleep and has no level 2")
        pick_transport(engine)
        before = engine.weight_version
        slot.run(engine.sleep(level=level))
        slot.run(engine.wake_up())
        with pytest.raises(WeightsInvalidated):
            slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(2))))
        assert slot.run(engine.info()).healthy is False
        assert self.push(slot, original_weights, before + 1) == before + 1
        outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(8))))
        assert tokens_of(outs) == reference
        assert all(c.weight_version == before + 1 for c in outs)


# ---- weight updates ---------------------------------------------------------------------------
class WeightUpdateTests(ConformanceBase):
    def test_push_changes_outputs_and_bumps_version(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]], original_weights: dict[str, Any]) -> None:
        from ..weights.checkpoint import perturbed

        pick_transport(engine)
        v0 = engine.weight_version
        with self.restoring(slot, original_weights):
            assert self.push(slot, perturbed(original_weights), v0 + 1) == v0 + 1
            assert engine.weight_version == v0 + 1
            outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(8))))
            assert tokens_of(outs) != reference, "perturbed weights must change greedy outputs"
            assert all(c.weight_version == v0 + 1 for c in outs)
            assert slot.run(engine.info()).weight_version == v0 + 1
            self.push(slot, original_weights, v0 + 2)
            outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(8))))
            assert tokens_of(outs) == reference, "pushing the original weights back must restore the outputs"
            assert all(c.weight_version == v0 + 2 for c in outs)

    @pytest.mark.parametrize("fault", ["unknown_name", "wrong_shape", "wrong_dtype"])
    def test_rejected_update_changes_nothing(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]], original_weights: dict[str, Any], fault: str) -> None:
        import torch

        from ..weights.checkpoint import perturbed

        pick_transport(engine)
        bad = perturbed(original_weights)  # if anything of it landed, outputs would change
        name = sorted(n for n, t in bad.items() if t.is_floating_point() and t.dim() == 2)[0]
        if fault == "unknown_name":
            bad["model.not_a_layer.weight"] = torch.zeros(4, 4, dtype=bad[name].dtype)
        elif fault == "wrong_shape":
            bad[name] = torch.zeros(bad[name].shape[0] + 1, bad[name].shape[1], dtype=bad[name].dtype)
        else:
            other = torch.float16 if bad[name].dtype != torch.float16 else torch.float32
            bad[name] = bad[name].to(other)
        v0 = engine.weight_version
        with pytest.raises(WeightSyncError) as info:
            self.push(slot, bad, v0 + 1)
        assert _has_mismatch(info.value), f"expected a ManifestMismatch, got {info.value!r}"
        assert engine.weight_version == v0
        outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(8))))
        assert tokens_of(outs) == reference
        assert all(c.weight_version == v0 for c in outs)
        # The next, valid push works.
        assert self.push(slot, original_weights, v0 + 1) == v0 + 1
        assert self.greedy_tokens(slot, prompt_ids) == reference

    def test_pause_holds_generation_until_resume(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
        need(engine, "pause")
        slot.run(engine.pause())
        assert slot.run(engine.info()).paused is True
        pending = slot.submit(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(8))))
        try:
            with pytest.raises(TimeoutError):
                pending.result(timeout=0.5)
        finally:
            slot.run(engine.resume())
        assert tokens_of(pending.result(timeout=CALL_TIMEOUT_S)) == reference
        assert slot.run(engine.info()).paused is False


# ---- LoRA adapters ----------------------------------------------------------------------------
from ..weights.lora import LORA_TARGETS, lora_targets, make_lora  # noqa: E402,F401  (tests import them from here)


async def collect_stream(engine: EngineProtocol, request: GenerateRequest) -> list[Any]:
    """Every delta ``engine.stream(request)`` yields."""
    return [d async for d in engine.stream(request)]


def start_in_flight(slot: EngineSlot, engine: EngineProtocol, request: GenerateRequest) -> Future[list[Completion]]:
    """Start ``engine.generate(request)`` on the slot's loop and return once the engine counts it
    outstanding (``info().outstanding``), or it is done.

    A fixed sleep after submitting races a slow transport: over HTTP on a busy machine the request may
    not have reached the engine yet, and a request the engine has not seen is not in flight."""
    import time

    pending = slot.submit(engine.generate(request))
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while not pending.done() and slot.run(engine.info()).outstanding < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the request was not in flight after {CALL_TIMEOUT_S:.0f} s")
        time.sleep(0.01)
    return pending


class LoraTests(ConformanceBase):
    """Adapters pushed with ``WeightSync.push_lora`` (capability ``lora``)."""

    def push_lora(self, slot: EngineSlot, spec: Any, tensors: dict[str, Any], version: int, **kw: Any) -> int:
        from ..weights.session import connect_weight_sync

        engine = slot.engine

        async def go() -> int:
            sync = await connect_weight_sync([engine], pick_transport(engine), timeout_s=120)
            try:
                return await sync.push_lora(spec, tensors, version=version, **kw)
            finally:
                await sync.close()

        return slot.run(go())

    def generate(self, slot: EngineSlot, prompt_ids: list[list[int]], lora: str | None = None, **kw: Any) -> list[Completion]:
        return slot.run(slot.engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(8, **kw), lora=lora)))

    @pytest.fixture
    def lora_engine(self, slot: EngineSlot, engine: EngineProtocol) -> Any:
        """The engine, for a test that loads adapters: skipped without capability ``lora``; every
        adapter still loaded afterwards is unloaded."""
        need(engine, "lora")
        pick_transport(engine)
        yield engine
        for name in list(slot.run(engine.info()).loras):
            slot.run(engine.unload_lora(name))

    def test_adapter_changes_outputs_and_unloading_restores_the_base(self, slot: EngineSlot, lora_engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]], original_weights: dict[str, Any]) -> None:
        engine = lora_engine
        logprobs = engine.capabilities.logprobs
        base = self.generate(slot, prompt_ids, logprobs=0 if logprobs else None)
        assert tokens_of(base) == reference and all(c.lora is None and c.lora_version is None for c in base)
        v0 = engine.weight_version
        spec, tensors = make_lora(original_weights, "conf-a")
        assert self.push_lora(slot, spec, tensors, 1) == 1
        assert engine.weight_version == v0, "a LoRA push leaves the base weights' version alone"
        assert slot.run(engine.info()).loras == {"conf-a": 1}
        adapted = self.generate(slot, prompt_ids, lora="conf-a")
        assert tokens_of(adapted) != reference, "an adapter with non-zero B must change greedy outputs"
        assert all(c.lora == "conf-a" and c.lora_version == 1 and c.weight_version == v0 for c in adapted)
        assert tokens_of(self.generate(slot, prompt_ids)) == reference, "requests without lora use the base model"
        assert slot.run(engine.unload_lora("conf-a")) is True
        assert slot.run(engine.unload_lora("conf-a")) is False
        assert slot.run(engine.info()).loras == {}
        again = self.generate(slot, prompt_ids, logprobs=0 if logprobs else None)
        assert tokens_of(again) == reference
        if logprobs:
            assert [c.logprobs for c in again] == [c.logprobs for c in base], "unloading must restore the base exactly"
        with pytest.raises(InvalidRequest):
            self.generate(slot, prompt_ids, lora="conf-a")

    def test_two_adapters_coexist_and_mix_in_one_batch(self, slot: EngineSlot, lora_engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]], original_weights: dict[str, Any]) -> None:
        engine = lora_engine
        if engine.capabilities.max_loras < 2:
            pytest.skip(f"backend '{engine.backend_name}' loads fewer than 2 adapters at once (max_loras)")
        for version, (name, seed) in enumerate((("conf-a", 1), ("conf-b", 2)), start=1):
            spec, tensors = make_lora(original_weights, name, seed=seed)
            self.push_lora(slot, spec, tensors, version)
        assert slot.run(engine.info()).loras == {"conf-a": 1, "conf-b": 2}
        alone = {name: tokens_of(self.generate(slot, prompt_ids, lora=name)) for name in ("conf-a", "conf-b")}
        assert alone["conf-a"] != alone["conf-b"] and reference not in alone.values()

        async def together() -> list[list[Completion]]:
            names = ["conf-a", None, "conf-b", "conf-a", None]
            return list(await asyncio.gather(*(engine.generate(GenerateRequest(
                prompt_token_ids=prompt_ids, sampling=greedy(8), lora=n)) for n in names)))

        a1, b1, b, a2, b2 = slot.run(together())
        assert tokens_of(a1) == tokens_of(a2) == alone["conf-a"]
        assert tokens_of(b) == alone["conf-b"] and all(c.lora == "conf-b" and c.lora_version == 2 for c in b)
        assert tokens_of(b1) == tokens_of(b2) == reference and all(c.lora is None for c in b1)
        assert slot.run(engine.unload_lora("conf-a")) is True
        assert tokens_of(self.generate(slot, prompt_ids, lora="conf-b")) == alone["conf-b"]
        assert tokens_of(self.generate(slot, prompt_ids)) == reference

    @pytest.mark.parametrize("fault", ["unknown_module", "wrong_shape", "missing_tensor", "extra_tensor", "rank_too_high"])
    def test_bad_adapter_is_refused_and_changes_nothing(self, slot: EngineSlot, lora_engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]], original_weights: dict[str, Any], fault: str) -> None:
        from ..types import MAX_LORA_RANK

        engine = lora_engine
        spec, tensors = make_lora(original_weights, "conf-a", seed=1)
        self.push_lora(slot, spec, tensors, 1)
        adapted = tokens_of(self.generate(slot, prompt_ids, lora="conf-a"))
        for name, version in (("conf-a", 2), ("conf-bad", 1)):  # a replacement and a new adapter
            if fault == "rank_too_high":
                if engine.capabilities.lora >= MAX_LORA_RANK:
                    pytest.skip("the engine serves every rank a LoraSpec allows")
                bad_spec, bad = make_lora(original_weights, name, rank=engine.capabilities.lora + 1, seed=3)
            else:
                bad_spec, bad = make_lora(original_weights, name, seed=3)
                first = sorted(bad)[0]
                if fault == "unknown_module":
                    bad_spec = bad_spec.model_copy(update={"target_modules": [*bad_spec.target_modules, "not_a_layer"]})
                elif fault == "wrong_shape":
                    bad[first] = bad[first][:, :-1].contiguous()
                elif fault == "missing_tensor":
                    del bad[first]
                else:
                    bad[first.replace(".lora_A.", ".lora_C.")] = bad[first].clone()
            with pytest.raises(WeightSyncError) as info:
                self.push_lora(slot, bad_spec, bad, version)
            assert _has_mismatch(info.value), f"expected a ManifestMismatch, got {info.value!r}"
            assert slot.run(engine.info()).loras == {"conf-a": 1}
            outs = self.generate(slot, prompt_ids, lora="conf-a")
            assert tokens_of(outs) == adapted and all(c.lora_version == 1 for c in outs)
            assert tokens_of(self.generate(slot, prompt_ids)) == reference
        # The session still works: the next, valid push is taken.
        spec2, tensors2 = make_lora(original_weights, "conf-a", seed=4)
        assert self.push_lora(slot, spec2, tensors2, 2) == 2

    def test_new_version_replaces_the_adapter(self, slot: EngineSlot, lora_engine: EngineProtocol, prompt_ids: list[list[int]], original_weights: dict[str, Any]) -> None:
        engine = lora_engine
        spec, v1 = make_lora(original_weights, "conf-a", seed=1)
        _, v2 = make_lora(original_weights, "conf-a", seed=2)
        self.push_lora(slot, spec, v1, 5)
        first = self.generate(slot, prompt_ids, lora="conf-a")
        self.push_lora(slot, spec, v2, 6)
        second = self.generate(slot, prompt_ids, lora="conf-a")
        assert tokens_of(second) != tokens_of(first) and all(c.lora_version == 6 for c in second)
        assert slot.run(engine.info()).loras == {"conf-a": 6}
        with pytest.raises(WeightSyncError) as info:
            self.push_lora(slot, spec, v1, 5)
        assert isinstance(info.value, StaleVersion), f"versions of an adapter must increase, got {info.value!r}"
        self.push_lora(slot, spec, v1, 5, allow_rollback=True)
        back = self.generate(slot, prompt_ids, lora="conf-a")
        assert tokens_of(back) == tokens_of(first) and all(c.lora_version == 5 for c in back)

    def test_base_push_keeps_adapters(self, slot: EngineSlot, lora_engine: EngineProtocol, prompt_ids: list[list[int]], reference: list[list[int]], original_weights: dict[str, Any]) -> None:
        from ..weights.checkpoint import perturbed

        engine = lora_engine
        spec, tensors = make_lora(original_weights, "conf-a", seed=1)
        self.push_lora(slot, spec, tensors, 1)
        adapted = tokens_of(self.generate(slot, prompt_ids, lora="conf-a"))
        v0 = engine.weight_version
        with self.restoring(slot, original_weights):
            self.push(slot, perturbed(original_weights), v0 + 1)
            assert slot.run(engine.info()).loras == {"conf-a": 1}
            outs = self.generate(slot, prompt_ids, lora="conf-a")
            assert all(c.weight_version == v0 + 1 and c.lora_version == 1 for c in outs)
            self.push(slot, original_weights, v0 + 2)
            assert tokens_of(self.generate(slot, prompt_ids, lora="conf-a")) == adapted
            assert tokens_of(self.generate(slot, prompt_ids)) == reference

    def test_stream_deltas_name_the_adapter(self, slot: EngineSlot, lora_engine: EngineProtocol, prompt_ids: list[list[int]], original_weights: dict[str, Any]) -> None:
        engine = lora_engine
        need(engine, "streaming")
        spec, tensors = make_lora(original_weights, "conf-stream", seed=6)
        self.push_lora(slot, spec, tensors, 3)
        request = GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(6), lora="conf-stream",
                                  request_ids=[f"lora-stream-{i}" for i in range(len(prompt_ids))])
        outs = slot.run(engine.generate(request))

        deltas = slot.run(collect_stream(engine, request))
        assert deltas and all(d.lora == "conf-stream" and d.lora_version == 3 for d in deltas)
        got: dict[str, list[int]] = {}
        for d in deltas:
            got.setdefault(d.request_id, []).extend(d.token_ids)
        assert got == {c.request_id: c.token_ids for c in outs}
        base = slot.run(collect_stream(engine, request.model_copy(update={"lora": None, "request_ids": [f"base-stream-{i}" for i in range(len(prompt_ids))]})))
        assert base and all(d.lora is None and d.lora_version is None for d in base)

    def test_unknown_adapter_is_an_invalid_request(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        expected: type[Exception] = InvalidRequest if engine.capabilities.lora else CapabilityError
        with pytest.raises(expected):
            self.generate(slot, prompt_ids, lora="never-loaded")
        assert slot.run(engine.unload_lora("never-loaded")) is False


# ---- lifecycle --------------------------------------------------------------------------------
class LifecycleTests(ConformanceBase):
    def test_close_is_idempotent_and_final(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        try:
            slot.run(engine.close())
            slot.run(engine.close())
            assert engine.closed
            with pytest.raises(EngineClosed):
                slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(2))))
            assert slot.run(engine.health()) is False
            if engine.capabilities.supports_sleep():
                with pytest.raises(EngineClosed):
                    slot.run(engine.sleep())
        finally:
            slot.discard()


# ---- async RL: ids, streaming, abort, pause modes, continuation, logprobs -----------------------
class AsyncRLTests(ConformanceBase):
    """Each test is gated on the capability it checks (``streaming``, ``abort``, ``pause_modes``,
    ``top_logprobs``, ``prompt_logprobs``, ``continuation``)."""

    def test_request_ids_on_completions(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        rids = [f"conf-{i}" for i in range(len(prompt_ids) * 2)]
        s = SamplingParams(temperature=1.0, max_tokens=3, n=2, seed=seed_if_declared(engine, 5))
        if not engine.capabilities.n:
            s, rids = greedy(3), rids[: len(prompt_ids)]
        outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=s, request_ids=rids)))
        assert [c.request_id for c in outs] == rids

    def test_stream_equals_generate_for_greedy(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        need(engine, "streaming")
        request = GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(12),
                                  request_ids=[f"stream-{i}" for i in range(len(prompt_ids))])
        outs = slot.run(engine.generate(request))

        async def collect() -> tuple[dict[str, list[int]], dict[str, str]]:
            got: dict[str, list[int]] = {}
            finish: dict[str, str] = {}
            async for d in engine.stream(request):
                assert d.request_id not in finish, "nothing may follow a sequence's last delta"
                got.setdefault(d.request_id, []).extend(d.token_ids)
                if d.finish_reason is not None:
                    finish[d.request_id] = d.finish_reason
            return got, finish

        got, finish = slot.run(collect())
        assert {c.request_id: c.token_ids for c in outs} == got
        assert {c.request_id: c.finish_reason for c in outs} == finish

    def test_abort_returns_partial_tokens_promptly(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        import time

        need(engine, "abort")
        # Near the tiny model's 2048-token context: ~1.3 s on the embedded engine, so the abort after
        # 0.3 s meets the request running on a quick machine too (1500 left a margin of 3x).
        max_tokens = 1900
        pending = start_in_flight(slot, engine, GenerateRequest(
            prompt_token_ids=prompt_ids[:1], sampling=greedy(max_tokens), request_ids=["conf-abort"]))
        time.sleep(0.3)
        slot.run(engine.abort(["conf-unknown"]))  # unknown ids are ignored
        start = time.monotonic()
        slot.run(engine.abort(["conf-abort"]))
        out = pending.result(timeout=ABORT_PATIENCE_S)[0]
        assert time.monotonic() - start < ABORT_PATIENCE_S
        assert out.finish_reason == "abort" and len(out.token_ids) < max_tokens
        assert out.request_id == "conf-abort"
        slot.run(engine.abort(["conf-abort"]))  # finished: ignored
        slot.run(engine.abort_all())  # nothing running: a no-op

    def test_pause_wait_drains(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        if "wait" not in engine.capabilities.pause_modes:
            pytest.skip(f"backend '{engine.backend_name}' does not declare pause mode 'wait' (capability 'pause_modes')")
        pending = start_in_flight(slot, engine, GenerateRequest(prompt_token_ids=prompt_ids[:1], sampling=greedy(200)))
        try:
            slot.run(engine.pause("wait"))
            # Done at the engine when the pause returns; over a channel the answer may still be on its way.
            assert slot.run(engine.info()).outstanding == 0, "pause('wait') returns once the requests in flight are done"
            out = pending.result(timeout=CALL_TIMEOUT_S)[0]
            assert out.finish_reason == "length" and len(out.token_ids) == 200
            later = slot.submit(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids[:1], sampling=greedy(2))))
            with pytest.raises(TimeoutError):
                later.result(timeout=0.3)
        finally:
            slot.run(engine.resume())
        assert len(later.result(timeout=CALL_TIMEOUT_S)[0].token_ids) == 2

    def test_keep_push_resume_continues_with_new_weights(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], original_weights: dict[str, Any]) -> None:
        import time

        from ..weights.checkpoint import perturbed

        if "keep" not in engine.capabilities.pause_modes:
            pytest.skip(f"backend '{engine.backend_name}' does not declare pause mode 'keep' (capability 'pause_modes')")
        pick_transport(engine)
        v0 = engine.weight_version
        with self.restoring(slot, original_weights):
            max_tokens = 1900  # near the tiny model's 2048-token context: the pause lands long before the end
            pending = start_in_flight(slot, engine, GenerateRequest(prompt_token_ids=prompt_ids[:1], sampling=greedy(max_tokens)))
            time.sleep(0.2)
            try:
                slot.run(engine.pause("keep"))
                assert not pending.done(), "the request finished before the pause; the engine is too fast for this test"
                assert self.push(slot, perturbed(original_weights), v0 + 1) == v0 + 1
            finally:
                slot.run(engine.resume())
            out = pending.result(timeout=CALL_TIMEOUT_S)[0]
            versions = out.versions()
            assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
            assert out.weight_version == v0 + 1
            assert out.token_weight_versions == versions, "a completion across a push records per-token versions"
            switch = versions.index(v0 + 1)
            assert 0 < switch and versions == [v0] * switch + [v0 + 1] * (max_tokens - switch)
            if engine.capabilities.continuation:
                # The tokens after the switch are those the new weights make from prompt + tokens so far.
                prefix = out.model_copy(update={"token_ids": out.token_ids[:switch], "logprobs": None,
                                                "token_weight_versions": None, "weight_version": v0})
                check = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids[:1], sampling=greedy(8),
                                                                 continue_from=[prefix])))[0]
                assert check.token_ids == out.token_ids[: switch + 8]
            self.push(slot, original_weights, v0 + 2)

    def test_top_logprobs_sorted_and_contain_the_sampled_token(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]]) -> None:
        need(engine, "top_logprobs")
        k = min(3, engine.capabilities.top_logprobs)
        s = SamplingParams(temperature=1.0, max_tokens=8, logprobs=1, top_logprobs=k, seed=seed_if_declared(engine, 2))
        outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=s)))
        for c in outs:
            assert c.top_logprobs is not None and len(c.top_logprobs) == len(c.token_ids)
            for token, top in zip(c.token_ids, c.top_logprobs, strict=True):
                values = [t.logprob for t in top]
                assert values == sorted(values, reverse=True)
                assert k <= len(top) <= k + 1
                assert token in [t.token_id for t in top]
            if c.logprobs is not None:
                for token, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
                    assert next(t.logprob for t in top if t.token_id == token) == pytest.approx(lp, abs=1e-3)

    def test_prompt_logprobs_match_a_forward_pass(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], model_path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        need(engine, "prompt_logprobs")
        outs = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(1, prompt_logprobs=2))))
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        tolerance = 1e-3 if engine.config.dtype == "float32" else 0.1
        for c, p in zip(outs, prompt_ids, strict=True):
            with torch.no_grad():
                lsm = model(torch.tensor([p])).logits[0].float().log_softmax(-1)
            ref = lsm[:-1].gather(-1, torch.tensor(p[1:])[:, None])[:, 0].tolist()
            assert c.prompt_logprobs is not None and len(c.prompt_logprobs) == len(p)
            assert c.prompt_logprobs[0] is None
            assert c.prompt_logprobs[1:] == pytest.approx(ref, abs=tolerance)
            if c.prompt_top_logprobs is not None:
                for j, top in enumerate(c.prompt_top_logprobs[1:]):
                    values = [t.logprob for t in top]
                    assert values[:2] == sorted(values[:2], reverse=True)
                    assert values[0] == pytest.approx(float(lsm[j].max()), abs=tolerance)

    def test_continue_from_gives_the_whole_response(self, slot: EngineSlot, engine: EngineProtocol, prompt_ids: list[list[int]], original_weights: dict[str, Any]) -> None:
        from ..weights.checkpoint import perturbed

        need(engine, "continuation")
        whole = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(10))))
        first = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(4))))
        rest = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(6), continue_from=first)))
        assert tokens_of(rest) == tokens_of(whole), "max_tokens counts the new tokens; the earlier ones come first"
        v0 = engine.weight_version
        assert all(c.versions() == [v0] * 10 for c in rest)
        if not engine.capabilities.transports:
            return
        self.push(slot, perturbed(original_weights), v0 + 1)
        more = slot.run(engine.generate(GenerateRequest(prompt_token_ids=prompt_ids, sampling=greedy(3), continue_from=first)))
        for m, f in zip(more, first, strict=True):
            assert m.token_ids[:4] == f.token_ids and len(m.token_ids) == 7
            assert m.versions() == [v0] * 4 + [v0 + 1] * 3 and m.token_weight_versions is not None
            assert m.weight_version == v0 + 1
        self.push(slot, original_weights, v0 + 2)


class BackendConformance(GenerationTests, SleepTests, WeightUpdateTests, LoraTests, AsyncRLTests, LifecycleTests):
    """Every standard test. Subclass it once per backend and provide ``engine_config``."""


# ---- `rollout-engines check` ------------------------------------------------------------------
_MODULE = '''\
import pytest

from rollout_engines.testing.conformance import BackendConformance
from rollout_engines.types import EngineConfig


class TestConformance(BackendConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls):
        return EngineConfig.model_validate_json({config_json!r})
'''


def run_conformance(
    backend: str,
    model: str | None = None,
    extra_pytest_args: list[str] | None = None,
    *,
    options: dict[str, Any] | None = None,
) -> int:
    """Run the conformance suite against ``backend`` (on ``model``, default the tiny model).

    Returns pytest's exit code (0: every test passed or was skipped for a missing capability).
    """
    from ..plugins import get_registry

    registry = get_registry()
    registry.load_backend(backend)  # unknown / not installed: a clear error now, not one per test
    if model is None:
        from .tiny_model import tiny_model_path

        model = str(tiny_model_path())
    config = EngineConfig(backend=backend, model=model, options=options or {})
    with tempfile.TemporaryDirectory(prefix="roe-conformance-") as tmp:
        root = Path(tmp)
        ini = "[pytest]\naddopts = -ra\n"
        if importlib.util.find_spec("pytest_asyncio") is not None:  # silence its unset-scope warning
            ini += "asyncio_default_fixture_loop_scope = function\n"
        (root / "pytest.ini").write_text(ini)
        test_file = root / f"test_conformance_{backend.replace('-', '_')}.py"
        test_file.write_text(textwrap.dedent(_MODULE.format(config_json=config.model_dump_json())))
        args = [str(test_file), "-c", str(root / "pytest.ini"), "--rootdir", tmp, "-p", "no:cacheprovider",
                # the CLI imported rollout_engines before pytest could hook assertion rewriting
                "-W", "ignore::pytest.PytestAssertRewriteWarning",
                *(extra_pytest_args or [])]
        # The generated module lives outside any package: let pytest import it by path.
        sys.path.insert(0, tmp)
        try:
            return int(pytest.main(args))
        finally:
            sys.path.remove(tmp)


__all__ = [
    "AsyncRLTests", "BackendConformance", "ConformanceBase", "EngineSlot", "GenerationTests", "LifecycleTests",
    "LoraTests", "SleepTests", "WeightUpdateTests", "make_lora", "need", "pick_transport", "run_conformance",
]
