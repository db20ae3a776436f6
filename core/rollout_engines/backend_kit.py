"""What every backend needs and no backend should write again: the rules that must not differ.

- :class:`LoopThread`: an event loop of its own on a daemon thread. Engine libraries bind their
  background tasks to the loop of their first call (vLLM's ``AsyncLLM``, SGLang's tokenizer
  manager), so a backend runs every call on one such loop and callers await it from any loop.
- :func:`validate_prompts`: the one context-window rule, ``len(prompt) + max_tokens <= max_model_len``,
  plus empty prompts and token ids outside the vocabulary, as :class:`~.errors.InvalidRequest`.
- :func:`finish_reason`: an engine library's finish reason as the core's ``FinishReason``.
- :func:`check_passed_options`: options a backend hands on to its library's own arguments must
  be arguments it has, and not ones the backend sets itself (they would be overridden silently).

Nothing here imports an engine library, torch or numpy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from .errors import InvalidRequest
from .types import FinishReason, GenerateRequest

logger = logging.getLogger("rollout_engines.backend_kit")

T = TypeVar("T")

#: Finish reasons the core knows; anything else an engine reports ends as ``"abort"``.
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort")


# ---- one event loop on a thread of its own ---------------------------------------------------------
class LoopThread:
    """An asyncio event loop running on a daemon thread named ``name``.

    ``work`` is an awaitable, or a function of no arguments returning one; a function is called on
    the loop's thread, for engine calls that must also be *made* there. Use :meth:`run` from
    blocking code, :meth:`call` from any event loop (the loop's own included), :meth:`submit` to
    start work without waiting. :meth:`close` stops the loop and joins the thread; it is idempotent.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the loop was closed some other way)."""
        return self.loop.is_closed() or not self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, work: Awaitable[T] | Callable[[], Awaitable[T]]) -> Future[T]:
        """Start ``work`` on the loop; returns a concurrent future (cancelling it cancels the work)."""
        if self.closed:
            _close_unawaited(work)
            raise RuntimeError(f"event loop thread '{self.name}' is closed")

        async def body() -> T:
            return await (work() if callable(work) else work)

        return asyncio.run_coroutine_threadsafe(body(), self.loop)

    def run(self, work: Awaitable[T] | Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """Run ``work`` on the loop and wait for its result (its exception is raised). Not from the
        loop's own thread. Past ``timeout`` seconds the work is cancelled and ``TimeoutError`` raised."""
        if threading.current_thread() is self._thread:
            _close_unawaited(work)
            raise RuntimeError(f"LoopThread.run called on '{self.name}' itself; await LoopThread.call instead")
        future = self.submit(work)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():  # the work's own TimeoutError
                raise
            future.cancel()
            raise TimeoutError(f"work on event loop thread '{self.name}' took longer than {timeout} s") from None

    async def call(self, work: Awaitable[T] | Callable[[], Awaitable[T]]) -> T:
        """Await ``work`` on the loop from any event loop; cancelling the caller cancels the work."""
        if asyncio.get_running_loop() is self.loop:
            return await (work() if callable(work) else work)
        return await asyncio.wrap_future(self.submit(work))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop and join its thread (waiting at most ``timeout`` seconds), then close the
        loop. Work still pending is dropped. Called on the loop's own thread, it only stops the loop."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            if threading.current_thread() is self._thread:
                return
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("event loop thread '%s' did not stop within %.0f s; left running", self.name, timeout)
                return
        self.loop.close()

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_unawaited(work: object) -> None:
    """Close a coroutine that will never run, so Python does not warn that it was never awaited."""
    if asyncio.iscoroutine(work):
        work.close()


# ---- prompt rules ------------------------------------------------------------------------------------
def validate_prompts(
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    max_model_len: int | None,
    vocab_size: int | None = None,
    continued: Sequence[Sequence[int] | None] | None = None,
) -> None:
    """Refuse prompts an engine cannot run, with :class:`~.errors.InvalidRequest` saying what to do.

    Per prompt, in this order: it is not empty; every token id is in ``[0, vocab_size)`` (when the
    backend knows ``vocab_size``); and the one context-window rule, ``len(prompt) + max_tokens <=
    max_model_len`` (when the backend knows ``max_model_len``). ``continued`` (partial rollouts:
    the earlier tokens each prompt continues, or None) are checked against the vocabulary too and
    count toward the window.
    """
    if continued is not None and len(continued) != len(prompts):
        raise ValueError(f"continued has {len(continued)} entries for {len(prompts)} prompts; give one per prompt")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise InvalidRequest(f"prompt {i} has no tokens; give at least one token (or some text)")
        earlier = continued[i] if continued is not None else None
        if vocab_size is not None:
            _check_vocabulary(f"prompt {i}", prompt, vocab_size)
            if earlier:
                _check_vocabulary(f"continue_from[{i}]", earlier, vocab_size)
        if max_model_len is None:
            continue
        used = len(prompt) + len(earlier or ())
        if used + max_tokens > max_model_len:
            parts = f"{len(prompt)} prompt tokens"
            if earlier:
                parts += f" + {len(earlier)} tokens it continues"
            raise InvalidRequest(
                f"prompt {i}: {parts} + max_tokens {max_tokens} = {used + max_tokens} exceed the context "
                f"window of {max_model_len} tokens (max_model_len); shorten the prompt, lower max_tokens "
                f"(at most {max(0, max_model_len - used)} here), or start the engine with a larger max_model_len"
            )


def _check_vocabulary(what: str, ids: Sequence[int], vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # min/max first: one pass in C for a good prompt
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidRequest(
            f"{what} has token id {bad} outside the model's vocabulary (size {vocab_size}); "
            "tokenize with the model's own tokenizer"
        )


# ---- options handed on to an engine library ---------------------------------------------------------
def check_passed_options(
    extra: Mapping[str, Any], target: type | None, *, library: str, own: Iterable[str],
    set_here: Mapping[str, str],
) -> None:
    """Refuse, before the library starts, an option a backend would hand on to ``target`` (its
    library's argument dataclass, e.g. ``vllm.AsyncEngineArgs``; ``None``: not checked) that is
    not one of its fields (with the nearest name among them and the backend's ``own`` options), or
    one of ``set_here`` (argument -> where to set it instead): :class:`ValueError` saying so."""
    import dataclasses
    import difflib

    fields = {f.name for f in dataclasses.fields(target)} if target is not None and dataclasses.is_dataclass(target) else None
    for key in extra:
        if key in set_here:
            raise ValueError(f"{library} argument {key!r} is set by rollout-engines; use {set_here[key]} instead")
        if fields is not None and key not in fields:
            near = difflib.get_close_matches(key, [*fields, *own], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"unknown option {key!r}: neither an option of this backend nor a {library} argument{hint}")


# ---- finish reasons ---------------------------------------------------------------------------------
def finish_reason(reason: Any) -> FinishReason:
    """An engine library's finish reason as the core's: ``"stop"``, ``"length"`` and ``"abort"``
    pass through (also as SGLang's ``{"type": ...}`` dicts); anything else (None, ``"error"``, a
    library's own kinds) is ``"abort"``: the sequence ended without reaching a stop or its length."""
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    for known in FINISH_REASONS:
        if kind == known:
            return known
    return "abort"


def check_continuations(request: GenerateRequest) -> None:
    """Refuse ``request.continue_from`` entries the continued completions could not be built from:
    logprobs (or top logprobs) asked for but missing for some earlier token, or per-token weight
    versions of the wrong length. :class:`~.errors.InvalidRequest` says what to send instead."""
    s = request.sampling
    for i, prior in enumerate(request.continue_from or ()):
        ids = prior.token_ids
        if s.logprobs is not None and ids and (prior.logprobs is None or len(prior.logprobs) != len(ids)):
            raise InvalidRequest(
                f"continue_from[{i}] has no logprob for each of its tokens, so the continued completion "
                "cannot carry logprobs; ask for logprobs in the first request too, or leave them out here"
            )
        if s.top_logprobs is not None and ids and (prior.top_logprobs is None or len(prior.top_logprobs) != len(ids)):
            raise InvalidRequest(
                f"continue_from[{i}] has no top_logprobs for each of its tokens; ask for them in the first "
                "request too, or leave them out here"
            )
        if prior.token_weight_versions is not None and len(prior.token_weight_versions) != len(ids):
            raise InvalidRequest(f"continue_from[{i}]: token_weight_versions must have one entry per token")


class PrefixCacheTracker:
    """Skips prefix-cache resets that cannot change anything: no request was submitted since the
    last reset (a reset walks every cached block, milliseconds on a large KV cache, and an RL loop
    asks for one after every push).

    ``submitted()`` per request handed to the engine library; ``dirty()`` before resetting (False:
    skip); ``reset_done(token)`` with ``dirty()``'s token once the reset succeeded; ``forget()``
    when the cache's state is unknown (memory released and restored): the next reset runs."""

    def __init__(self) -> None:
        self.count = 0
        self._at_reset = -1

    def submitted(self) -> None:
        self.count += 1

    def dirty(self) -> int | None:
        """None: nothing can be cached since the last reset; else a token for :meth:`reset_done`."""
        return None if self.count == self._at_reset else self.count

    def reset_done(self, token: int) -> None:
        self._at_reset = token

    def forget(self) -> None:
        self._at_reset = -1
