"""The engine interface, the rules every backend shares, and the capabilities it declares.

Two layers (a third, hosts, is :mod:`rollout_engines.proxy`):

- :class:`EngineProtocol`: the interface, an ABC of the public async methods and the few
  attributes a caller reads. Callers, proxies and type checkers depend on it.
- :class:`Engine`: the shared rules. A backend subclasses it and fills in the ``_``-prefixed hooks;
  its public methods hold what must not differ between backends: closed/asleep/invalid-weights
  checks, capability checks with a clear :class:`CapabilityError`, pause/resume, version tagging,
  prefix-cache resets after wake-up and updates, the outstanding-request count and the lifecycle
  hooks for plugins.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from .backend_kit import LoopThread
from .errors import (
    CapabilityError,
    EngineAsleep,
    EngineClosed,
    InvalidRequest,
    StaleVersion,
    UpdateRefused,
    WeightsInvalidated,
    WeightSyncError,
)
from .spec import Capabilities
from .types import (
    Completion,
    Diagnostics,
    EngineConfig,
    EngineInfo,
    GenerateRequest,
    LastReceive,
    PauseMode,
    StreamDelta,
)
from .weights.manifest import TransportSpec, WeightManifest

logger = logging.getLogger("rollout_engines")

SLEEP_TAGS = ("weights", "kv_cache")
#: Seconds a weight-sync join may take beyond its spec's timeout before it is given up.
INIT_GRACE_S = 10.0
T = TypeVar("T")


def require(capabilities: Capabilities, flag: str, backend: str, what: str) -> None:
    if not getattr(capabilities, flag):
        raise CapabilityError(f"backend '{backend}' cannot {what} (capability '{flag}' is not declared)")


class EngineProtocol(abc.ABC):
    """What a caller may do with an engine, wherever it runs (the interface, no rules).

    Implemented by :class:`Engine` (backends, groups) and by
    :class:`~rollout_engines.proxy.ProxyEngine` (an engine in another process, actor or server,
    whose own :class:`Engine` applies the rules). :meth:`methods` lists the public async methods;
    a test checks that every proxy forwards each of them.
    """

    backend_name: ClassVar[str] = "?"
    capabilities: Capabilities = Capabilities()
    config: EngineConfig
    weight_version: int
    #: Loaded LoRA adapters: name -> version.
    loras: dict[str, int]

    @classmethod
    def methods(cls) -> tuple[str, ...]:
        """The protocol's public async methods, in declaration order."""
        return tuple(name for name, value in vars(EngineProtocol).items()
                     if inspect.isfunction(value) and getattr(value, "__isabstractmethod__", False))

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> list[Completion]: ...

    @abc.abstractmethod
    def stream(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]: ...

    @abc.abstractmethod
    async def abort(self, request_ids: Sequence[str]) -> None: ...

    @abc.abstractmethod
    async def abort_all(self) -> None: ...

    @abc.abstractmethod
    async def chat(self, request: GenerateRequest) -> list[Completion]: ...

    @abc.abstractmethod
    async def sleep(self, level: int = 1, tags: Sequence[str] | None = None) -> None: ...

    @abc.abstractmethod
    async def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None: ...

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = "wait") -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def init_weight_transfer(self, spec: TransportSpec) -> None: ...

    @abc.abstractmethod
    async def receive_weights(self, manifest: WeightManifest) -> int: ...

    @abc.abstractmethod
    async def close_weight_transfer(self) -> None: ...

    @abc.abstractmethod
    async def unload_lora(self, name: str) -> bool: ...

    @abc.abstractmethod
    async def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    async def health(self) -> bool: ...

    @abc.abstractmethod
    async def diagnostics(self, fingerprint: bool = False) -> Diagnostics: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    # ---- plain attributes every engine has -----------------------------------------------------
    @property
    def model(self) -> str:
        return self.config.model

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    def weight_receivers(self) -> int:
        """How many ranks this engine occupies in a broadcast group (one per worker)."""
        return max(1, self.config.tensor_parallel_size) if self.capabilities.multi_process else 1

    def pause_modes(self) -> tuple[PauseMode, ...]:
        caps = self.capabilities
        plain: tuple[PauseMode, ...] = ("wait",) if caps.pause else ()
        return tuple(dict.fromkeys(plain + caps.pause_modes))

    async def __aenter__(self) -> EngineProtocol:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Gate:
    """Open or shut; :meth:`wait` returns once it is open. Like an open-by-default
    :class:`asyncio.Event`, but bound to no event loop: one engine serves callers on any loop (a
    loop per test, a blocking wrapper's own), and an ``Event`` that once made a caller wait belongs
    to that caller's loop. Each waiter waits on a future of its own loop."""

    def __init__(self) -> None:
        self._open = True
        self._waiters: list[asyncio.Future[None]] = []
        self._lock = threading.Lock()  # loops on other threads may wait and open at once

    def is_set(self) -> bool:
        return self._open

    def clear(self) -> None:
        self._open = False

    def set(self) -> None:
        with self._lock:
            self._open = True
            waiters, self._waiters = self._waiters, []
        for future in waiters:
            loop = future.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(_release, future)

    async def wait(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._open:
                return
            self._waiters.append(future)
        try:
            await future
        finally:
            with self._lock:
                if future in self._waiters:
                    self._waiters.remove(future)


async def abort_repeatedly(
    abort: Callable[[list[str]], Awaitable[None]], ids: list[str], what: str, for_s: float | None = None,
) -> None:
    """``abort(ids)`` now and again, more and more slowly (up to every 50 ms), until cancelled (the
    request ended) or ``for_s`` passed: an engine takes a request a moment after its call started
    (in another process, or on another thread), and an abort of an id it does not know yet is a
    no-op. An abort that fails ends the repeats (logged as ``what``)."""
    delay, deadline = 0.0, None if for_s is None else time.monotonic() + for_s
    while deadline is None or time.monotonic() < deadline:
        await asyncio.sleep(delay)
        try:
            await abort(ids)
        except Exception as exc:
            logger.debug("abort of %s (%s) failed: %r", ids, what, exc)
            return
        delay = min(0.05, delay * 2 or 0.002)


def _release(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Engine(EngineProtocol):
    """Base class of every backend. Async first; see :class:`BlockingEngine` for scripts."""

    #: Drop cached prefixes after waking (stale KV after wake gives garbage, vllm#17103). Engines
    #: made of engines (EngineGroup) leave it to their members. Engines in another process are
    #: reached through a proxy, whose far engine applies this rule itself: there is no second flag.
    reset_prefix_cache_on_wake: ClassVar[bool] = True
    #: Whether a weight update stops generation while it is applied (vLLM and SGLang apply it in
    #: their scheduler loop, between two steps): ``info().held_s`` then counts updates as held time.
    updates_hold_generation: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.weight_version = 0
        self._asleep: set[str] = set()
        self._weights_invalid: str | None = None
        self._closed = False
        self._outstanding = 0
        self._resumed = _Gate()
        self._paused = False
        self._paused_at = 0.0
        self._paused_total_s = 0.0  # info().paused_s
        self._held_depth = 0  # info().held_s: paused, or inside an update that holds generation
        self._held_since = 0.0
        self._held_total_s = 0.0
        self._pause_mode: PauseMode | None = None
        # request id -> aborted, for requests waiting at the pause gate (see _pass_gate)
        self._gated: dict[str, bool] = {}
        self._weight_update_lock = threading.Lock()
        #: The update being received: (version, monotonic start, its timeout), else None.
        self._receiving: tuple[int, float, float] | None = None
        #: Loaded LoRA adapters: name -> version (kept by this class; backends keep the tensors).
        self.loras: dict[str, int] = {}
        #: Set by backends that measure them; read through :meth:`diagnostics`.
        self._last_receive: LastReceive | None = None
        self._last_reset_s: float | None = None

    # ---- backend hooks -------------------------------------------------------------------------
    @abc.abstractmethod
    async def _generate(self, request: GenerateRequest) -> list[Completion]: ...

    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        raise CapabilityError(f"backend '{self.backend_name}' does not support sleep")

    async def _wake_up(self, tags: Sequence[str]) -> None:
        raise CapabilityError(f"backend '{self.backend_name}' does not support wake_up")

    async def _reset_prefix_cache(self) -> None:
        return None

    async def _forget_cached_prefixes(self) -> None:
        """After a weight update: make sure no prefix computed with the old weights is reused. The
        default resets the prefix cache; a backend that keys its cache by weight version (vLLM's
        ``prefix_cache_isolation="salt"``) has nothing to do."""
        await self._reset_prefix_cache()

    async def _pause(self, mode: PauseMode) -> None:
        return None

    async def _stream(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        """Deltas of a request whose ``request_ids`` are set. Default, for backends without
        streaming: one delta per completion, once the whole request is done."""
        for c in await self._generate(request):
            yield StreamDelta(
                request_id=c.request_id, prompt_index=c.prompt_index, sample_index=c.sample_index,
                token_ids=c.token_ids, logprobs=c.logprobs, top_logprobs=c.top_logprobs,
                weight_version=c.weight_version, finish_reason=c.finish_reason,
                lora=c.lora, lora_version=c.lora_version,
            )

    async def _abort(self, request_ids: Sequence[str] | None) -> None:
        """End these running requests now (``None``: all); unknown ids are ignored."""
        raise CapabilityError(f"backend '{self.backend_name}' cannot abort requests")

    async def _resume(self) -> None:
        return None

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        raise CapabilityError(f"backend '{self.backend_name}' cannot receive weights")

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        raise CapabilityError(f"backend '{self.backend_name}' cannot receive weights")

    async def _close_weight_transfer(self) -> None:
        return None

    async def _receive_lora(self, manifest: WeightManifest) -> None:
        """Receive the LoRA adapter ``manifest.lora`` (its tensors, PEFT-named) and install it
        atomically under its name, replacing an earlier version of it only once complete; validate
        it against the base model first (:func:`rollout_engines.weights.lora.lora_expected_specs`).
        Backends with ``capabilities.lora`` implement it."""
        raise CapabilityError(f"backend '{self.backend_name}' cannot load LoRA adapters")

    async def _unload_lora(self, name: str) -> None:
        """Forget the loaded adapter ``name`` (known to be loaded); base outputs are unchanged."""
        raise CapabilityError(f"backend '{self.backend_name}' cannot load LoRA adapters")

    async def _close(self) -> None:
        return None


    def _extra_info(self) -> dict[str, Any]:
        return {}

    async def _diagnostics(self, fingerprint: bool) -> Diagnostics:
        """What :meth:`diagnostics` answers. Backends extend it (``model_copy(update=...)`` of this
        one) with what they know: platform, weights dtype, a weights fingerprint when asked."""
        return Diagnostics(
            backend=self.backend_name, weight_version=self.weight_version,
            last_receive=self._last_receive, last_reset_s=self._last_reset_s,
        )

    def _outstanding_count(self) -> int:
        return self._outstanding

    def _can_serve(self) -> bool:
        """Readiness (``info().healthy``): generation would be accepted now. Liveness is
        :meth:`health` (not closed, no update stuck), which an asleep or invalidated engine keeps."""
        return not self._closed and self._weights_invalid is None and not self._receive_stuck()

    def _receive_stuck(self) -> bool:
        """A receive that outlived its own timeout (every wait in it is bounded by that timeout,
        so something below the transport hangs)."""
        r = self._receiving
        return r is not None and time.monotonic() - r[1] > r[2] + 5.0

    def _receive_info(self) -> dict[str, Any]:
        r = self._receiving
        if r is None:
            return {}
        seconds = time.monotonic() - r[1]
        return {"weight_update": {"version": r[0], "seconds": round(seconds, 3), "timeout_s": r[2],
                                  "stuck": self._receive_stuck()}}

    # ---- public API ----------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise EngineClosed(f"engine '{self.backend_name}' is closed; create a new one")
        if self._asleep:
            raise EngineAsleep(
                f"engine '{self.backend_name}' is asleep (released: {', '.join(sorted(self._asleep))}); "
                "call wake_up() first"
            )
        if self._weights_invalid:
            raise WeightsInvalidated(
                f"engine '{self.backend_name}' refuses to generate: {self._weights_invalid}. "
                "Push a complete set of weights (WeightSync.push) to continue"
            )

    def _check_request(self, request: GenerateRequest) -> None:
        caps, name = self.capabilities, self.backend_name
        s = request.sampling
        if request.messages is not None:
            require(caps, "chat", name, "apply chat templates")
        if s.logprobs is not None:
            require(caps, "logprobs", name, "return logprobs")
        if s.n > 1:
            require(caps, "n", name, "return several samples per prompt")
        if s.stop:
            require(caps, "stop_strings", name, "stop on strings")
        if s.top_logprobs and s.top_logprobs > caps.top_logprobs:
            raise CapabilityError(
                f"backend '{name}' returns at most {caps.top_logprobs} top logprobs per position, "
                f"not {s.top_logprobs} (capability 'top_logprobs')"
            )
        if s.prompt_logprobs is not None:
            require(caps, "prompt_logprobs", name, "return prompt logprobs")
        if request.continue_from is not None:
            require(caps, "continuation", name, "continue earlier completions (continue_from)")
        if request.lora is not None:
            if not caps.lora:
                raise CapabilityError(f"backend '{name}' cannot serve LoRA adapters (capability 'lora')")
            if request.lora not in self.loras:
                raise InvalidRequest(
                    f"LoRA adapter '{request.lora}' is not loaded on engine '{name}' (loaded: "
                    f"{', '.join(sorted(self.loras)) or 'none'}); push it with WeightSync.push_lora first"
                )

    @staticmethod
    def _with_ids(request: GenerateRequest) -> GenerateRequest:
        """The request with an id for every prompt x sample (the caller's, or new ones)."""
        if request.request_ids is not None:
            return request
        return request.model_copy(update={"request_ids": request.sequence_ids()})

    async def _pass_gate(self, request: GenerateRequest) -> set[str]:
        """Wait while paused; returns the ids of ``request`` aborted meanwhile (:meth:`abort`)."""
        if self._resumed.is_set():
            return set()
        ids = request.request_ids or ()
        gated = self._gated
        for rid in ids:
            gated[rid] = False
        try:
            await self._resumed.wait()
        finally:
            aborted = {rid for rid in ids if gated.pop(rid, False)}
        return aborted

    async def _admitted(self, request: GenerateRequest) -> tuple[GenerateRequest, set[str], bool]:
        """What :meth:`generate` and :meth:`stream` do before they run a request: check it, give it
        ids, wait at the pause gate. Returns the request with its ids, the ids aborted while it
        waited, and whether that was all of them (then it is not run)."""
        self._check_usable()
        self._check_request(request)
        request = self._with_ids(request)
        aborted = await self._pass_gate(request)
        self._check_usable()
        return request, aborted, bool(aborted) and len(aborted) >= len(request.request_ids or ())

    #: How long the ids of a request aborted while a pause held it are aborted again and again
    #: until the backend knows them (see :func:`abort_repeatedly`).
    ABORT_RETRY_S: ClassVar[float] = 2.0

    @contextlib.asynccontextmanager
    async def _aborting(self, aborted: set[str]) -> AsyncGenerator[None, None]:
        """Around a request some of whose ids were aborted while it waited at the gate: abort them
        as soon as the backend knows them (an abort of an id it does not know yet is a no-op)."""
        if not aborted:
            yield
            return

        task = asyncio.ensure_future(
            abort_repeatedly(self._abort, sorted(aborted), "held while paused", for_s=self.ABORT_RETRY_S)
        )
        try:
            yield
        finally:
            task.cancel()

    def _aborted_unrun(self, request: GenerateRequest) -> list[Completion]:
        """What a request aborted as a whole before it ran returns: no tokens, ``finish_reason="abort"``."""
        ids, n = request.request_ids or (), request.sampling.n
        prompts = request.prompt_token_ids or [[] for _ in range(request.batch_size)]
        return [
            Completion(request_id=rid, prompt_index=i // n, sample_index=i % n, prompt_token_ids=list(prompts[i // n]),
                       token_ids=[], finish_reason="abort", weight_version=self.weight_version)
            for i, rid in enumerate(ids)
        ]

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        """Generate for every prompt of the batch; returns batch_size * n completions, prompt-major."""
        request, aborted, unrun = await self._admitted(request)
        if unrun:
            return self._aborted_unrun(request)
        self._outstanding += 1
        try:
            async with self._aborting(aborted):
                outs = await self._generate(request)
        finally:
            self._outstanding -= 1
        ids = request.request_ids or ()
        for c, rid in zip(outs, ids, strict=False):
            if not c.request_id:
                c.request_id = rid
        return outs

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        """Generate, yielding :class:`StreamDelta` objects (new tokens of one prompt x sample) as
        they are made; the last delta of each sequence carries its ``finish_reason``. The engine
        produces no faster than the caller consumes (bounded buffers). Backends without the
        ``streaming`` capability yield each sequence whole when it is done."""
        request, aborted, unrun = await self._admitted(request)
        if unrun:
            for c in self._aborted_unrun(request):
                yield StreamDelta(request_id=c.request_id, prompt_index=c.prompt_index, sample_index=c.sample_index,
                                  weight_version=c.weight_version, finish_reason="abort")
            return
        self._outstanding += 1
        inner = self._stream(request)
        try:
            async with self._aborting(aborted):
                async for delta in inner:
                    yield delta
        finally:
            self._outstanding -= 1
            # A caller that stops early ends the backend's stream now (its requests are cancelled),
            # not whenever the event loop collects the generator.
            await inner.aclose()

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Finish these requests now: each returns (or streams its last delta) promptly with
        ``finish_reason="abort"`` and the tokens made so far. A request held by a pause is not run
        after :meth:`resume` (it returns no tokens). Unknown or finished ids are ignored."""
        require(self.capabilities, "abort", self.backend_name, "abort requests")
        self._check_not_closed()
        ids = list(request_ids)
        gated = self._gated
        for rid in ids:
            if rid in gated:
                gated[rid] = True
        await self._abort(ids)

    async def abort_all(self) -> None:
        """:meth:`abort` every running request, and every request a pause holds."""
        require(self.capabilities, "abort", self.backend_name, "abort requests")
        self._check_not_closed()
        for rid in list(self._gated):
            self._gated[rid] = True
        await self._abort(None)

    async def chat(self, request: GenerateRequest) -> list[Completion]:
        if request.messages is None:
            raise ValueError("chat() needs request.messages")
        return await self.generate(request)

    async def sleep(self, level: int = 1, tags: Sequence[str] | None = None) -> None:
        """Release memory: ``tags`` any of 'weights', 'kv_cache' (default both)."""
        caps = self.capabilities
        if not caps.supports_sleep():
            raise CapabilityError(
                f"backend '{self.backend_name}' does not support sleep on this platform; "
                "check engine.capabilities.sleep_levels before calling"
            )
        if level not in caps.sleep_levels:
            raise CapabilityError(
                f"backend '{self.backend_name}' supports sleep levels {list(caps.sleep_levels)}, not {level}"
            )
        tags = list(tags or caps.sleep_tags)
        self._check_tags(tags)
        self._check_not_closed()
        await self._sleep(level, tags)
        self._asleep.update(tags)
        if "weights" in tags and (level >= 2 or not caps.weights_kept_on_sleep):
            self._weights_invalid = (
                f"weights were discarded by sleep(level={level}) and not pushed again since"
            )

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._check_not_closed()
        tags = list(tags or sorted(self._asleep))
        self._check_tags(tags)
        todo = [t for t in tags if t in self._asleep]
        if todo:
            await self._wake_up(todo)
            self._asleep.difference_update(todo)
            if self.reset_prefix_cache_on_wake:
                await self._reset_prefix_cache()

    async def reset_prefix_cache(self) -> None:
        self._check_not_closed()
        await self._reset_prefix_cache()

    async def pause(self, mode: PauseMode = "wait") -> None:
        """Hold new generation until :meth:`resume`. In-flight requests: ``wait`` lets them finish
        (this returns when they did), ``abort`` ends them now with their partial results,
        ``keep`` freezes them where they are; they continue after :meth:`resume`, with the weights
        current then (a push while paused in ``keep`` mode is allowed; per-token versions show
        the switch)."""
        modes = self.pause_modes()
        if mode not in modes:
            raise CapabilityError(
                f"backend '{self.backend_name}' cannot pause in mode '{mode}'; it supports: "
                f"{', '.join(modes) or 'none'} (capability 'pause_modes')"
            )
        self._check_not_closed()
        if not self._paused:
            self._paused_at = time.perf_counter()
            self._hold()
        self._paused = True
        self._pause_mode = mode
        self._resumed.clear()
        await self._pause(mode)
        # ``wait`` and ``abort`` return once every call that passed the gate before the pause has
        # returned (``info().outstanding`` is 0), whatever the backend's own drain looked at.
        while mode != "keep" and self._outstanding:
            await asyncio.sleep(0.005)

    async def resume(self) -> None:
        self._check_not_closed()
        await self._resume()
        if self._paused:
            self._paused_total_s += time.perf_counter() - self._paused_at
            self._unhold()
        self._paused, self._pause_mode = False, None
        self._resumed.set()

    def _hold(self) -> None:
        """Generation is held from now (a pause, or an update that holds it) until :meth:`_unhold`;
        overlapping holds count once in ``info().held_s``."""
        if self._held_depth == 0:
            self._held_since = time.perf_counter()
        self._held_depth += 1

    def _unhold(self) -> None:
        self._held_depth -= 1
        if self._held_depth == 0:
            self._held_total_s += time.perf_counter() - self._held_since

    @contextlib.contextmanager
    def _update_hold(self) -> Iterator[None]:
        """Around a weight update: held time where this backend's updates stop generation."""
        if not self.updates_hold_generation:
            yield
            return
        self._hold()
        try:
            yield
        finally:
            self._unhold()

    def _held_s(self) -> float:
        return self._held_total_s + (time.perf_counter() - self._held_since if self._held_depth else 0.0)

    async def init_weight_transfer(self, spec: TransportSpec) -> None:
        """Join a trainer's weight-sync session (called by :func:`connect_weight_sync`)."""
        self._check_not_closed()
        if spec.transport not in self.capabilities.transports:
            raise CapabilityError(
                f"backend '{self.backend_name}' cannot receive weights over '{spec.transport}'; "
                f"it supports: {', '.join(self.capabilities.transports) or 'none'}"
            )
        # Joining waits on the trainer; the transport bounds its own waits by spec.timeout_s, and
        # this bounds the whole (a peer that accepts a connection and never answers included).
        try:
            await asyncio.wait_for(self._init_weight_transfer(spec), spec.timeout_s + INIT_GRACE_S)
        except asyncio.TimeoutError:
            raise WeightSyncError(
                f"engine '{self.backend_name}' could not join the '{spec.transport}' weight sync within "
                f"{spec.timeout_s + INIT_GRACE_S:.0f} s; check the trainer's address and that it is alive",
                peer="trainer (rank 0)",
            ) from None

    async def receive_weights(self, manifest: WeightManifest) -> int:
        """Receive one complete update described by ``manifest``; returns the new version.

        Validates the whole manifest before anything is applied. On failure the previous weights
        stay in place (or, for in-place backends, generation is refused until the next full push).
        The version must be above the current one unless ``manifest.allow_rollback``
        (:class:`StaleVersion` otherwise, before anything is received).
        """
        from .plugins import get_registry

        self._check_not_closed()
        if manifest.lora is not None:
            return await self._receive_lora_checked(manifest)
        if "weights" in self._asleep:
            raise EngineAsleep(
                f"engine '{self.backend_name}' has released its weights; call wake_up(tags=['weights']) "
                "before pushing"
            )
        if not manifest.allow_rollback and manifest.version <= self.weight_version:
            raise StaleVersion(
                f"engine '{self.backend_name}' refuses weight update v{manifest.version}: it serves "
                f"v{self.weight_version} and versions must increase (allow_rollback=True to go back)"
            )
        hooks = get_registry().hooks
        hooks.before_weight_update(engine=self, manifest=manifest)
        start, error = time.perf_counter(), None
        with self._update_hold():
            self._receiving = (manifest.version, time.monotonic(), manifest.timeout_s)
            try:
                await self._receive_weights(manifest)
            except BaseException as exc:
                error = exc
                raise
            finally:
                self._receiving = None
                hooks.after_weight_update(
                    engine=self, manifest=manifest, seconds=time.perf_counter() - start, error=error
                )
            self.weight_version = manifest.version
            self._weights_invalid = None
            await self._forget_cached_prefixes()
        return self.weight_version

    async def close_weight_transfer(self) -> None:
        await self._close_weight_transfer()

    async def _receive_lora_checked(self, manifest: WeightManifest) -> int:
        """A LoRA push: the shared rules (capability, rank, slots, versions per adapter), then the
        backend's :meth:`_receive_lora`. The base weights and their version are untouched."""
        spec = manifest.lora
        assert spec is not None
        caps, name = self.capabilities, self.backend_name
        if not caps.lora:
            raise CapabilityError(f"backend '{name}' cannot load LoRA adapters (capability 'lora')")
        if spec.rank > caps.lora:
            raise UpdateRefused(
                f"LoRA adapter '{spec.name}' has rank {spec.rank}; engine '{name}' serves ranks up to "
                f"{caps.lora} (raise the backend's max LoRA rank option)"
            )
        if spec.name not in self.loras and len(self.loras) >= caps.max_loras:
            raise UpdateRefused(
                f"engine '{name}' already holds {len(self.loras)} LoRA adapters (max_loras={caps.max_loras}); "
                f"unload_lora() one of {sorted(self.loras)} first"
            )
        current = self.loras.get(spec.name)
        if current is not None and not manifest.allow_rollback and manifest.version <= current:
            raise StaleVersion(
                f"engine '{name}' refuses LoRA '{spec.name}' v{manifest.version}: it holds v{current} "
                "and versions must increase (allow_rollback=True to go back)"
            )
        self._receiving = (manifest.version, time.monotonic(), manifest.timeout_s)
        try:
            with self._update_hold():
                await self._receive_lora(manifest)
        finally:
            self._receiving = None
        self.loras[spec.name] = manifest.version
        return manifest.version

    async def unload_lora(self, name: str) -> bool:
        """Unload the LoRA adapter ``name``; returns whether it was loaded (unknown names: False).
        Requests that name it afterwards are refused; base-model outputs are unchanged."""
        self._check_not_closed()
        if name not in self.loras:
            return False
        await self._unload_lora(name)
        del self.loras[name]
        return True

    async def info(self) -> EngineInfo:
        return EngineInfo(
            backend=self.backend_name,
            model=self.config.model,
            weight_version=self.weight_version,
            asleep=sorted(self._asleep),
            paused=self._paused,
            paused_s=self._paused_total_s + (time.perf_counter() - self._paused_at if self._paused else 0.0),
            held_s=self._held_s(),
            outstanding=self._outstanding_count(),
            healthy=self._can_serve(),
            capabilities=self.capabilities.model_dump(),
            loras=dict(self.loras),
            extra={**self._extra_info(), **self._receive_info()},
        )

    async def health(self) -> bool:
        """Alive: not closed, and no weight update stuck past its timeout."""
        return not self._closed and not self._receive_stuck()

    async def diagnostics(self, fingerprint: bool = False) -> Diagnostics:
        """Where the engine's time went lately (the last weight update by phase and worker, the last
        prefix-cache reset) and what its weights are (platform, dtype). Cheap, except that
        ``fingerprint=True`` also asks the engine for a fingerprint of its weights, where it can
        make one without generating (e.g. vLLM on CUDA: every worker's parameter sums)."""
        if fingerprint:
            self._check_not_closed()
        return await self._diagnostics(fingerprint)

    async def close(self) -> None:
        """Free everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._resumed.set()
        try:
            await self._close()
        finally:
            from .plugins import get_registry

            get_registry().hooks.engine_closed(engine=self)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- helpers -------------------------------------------------------------------------------
    def _check_not_closed(self) -> None:
        if self._closed:
            raise EngineClosed(f"engine '{self.backend_name}' is closed; create a new one")

    def _check_tags(self, tags: Sequence[str]) -> None:
        allowed = self.capabilities.sleep_tags or SLEEP_TAGS
        bad = [t for t in tags if t not in allowed]
        if bad:
            raise ValueError(f"unknown sleep tags {bad}; allowed: {list(allowed)}")


class BlockingEngine:
    """A blocking facade over an async engine for scripts and notebooks.

    Runs its own event loop in a background thread, so it works inside Jupyter as well.
    """

    def __init__(self, engine: EngineProtocol) -> None:
        self.engine = engine
        self._loop_thread = LoopThread("roe-blocking")

    def _run(self, factory: Callable[[], Awaitable[T]]) -> T:
        return self._loop_thread.run(factory)

    def generate(self, request: GenerateRequest) -> list[Completion]:
        return self._run(lambda: self.engine.generate(request))

    def sleep(self, level: int = 1, tags: Sequence[str] | None = None) -> None:
        self._run(lambda: self.engine.sleep(level, tags))

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._run(lambda: self.engine.wake_up(tags))

    def reset_prefix_cache(self) -> None:
        self._run(self.engine.reset_prefix_cache)

    def info(self) -> EngineInfo:
        return self._run(self.engine.info)

    def close(self) -> None:
        if self._loop_thread.closed:
            return
        self._run(self.engine.close)
        self._loop_thread.close()

    def __enter__(self) -> BlockingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
