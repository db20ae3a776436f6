"""``ProxyEngine``: an engine that runs somewhere else, reached over a :class:`Channel`.

Every host of an engine outside the caller's process is this one class over one channel: a child
process's pipe (:mod:`rollout_engines.process`), a Ray actor (:mod:`rollout_engines.ray`), a
rollout-engines server over HTTP and an in-process adapter (the ``remote`` backend). The rules,
each stated once here:

1. **The far engine keeps the rules.** It is an :class:`~rollout_engines.engine.Engine` running
   this core: closed/asleep/invalid-weights checks, capability checks, prefix-cache resets after a
   wake-up and after every update, version tags. The proxy checks only that it is not closed
   itself, so it never acts on stale state and never resets a cache a second time.
2. **Capabilities are fetched at connect** (the far engine's :meth:`EngineHost.describe`) and
   declared as seen from here: ``multi_process`` is set, in-process transports (``inproc``) are
   dropped.
3. **Arguments and results cross as wire values** made from the protocol's own signatures
   (:class:`~rollout_engines.engine.EngineProtocol`): each parameter is encoded and validated
   with its type hint, so adding a method to the protocol is one forwarding line in
   :class:`ProxyEngine`, and ``tests/test_proxies.py`` checks that every proxy forwards every
   method.
4. **One error wire format**, :class:`WireError`: type name, message, ``peer``/``bucket``. The
   caller gets the same class back where it is one of ours or a builtin; a pydantic
   ``ValidationError`` on the far side becomes :class:`ManifestMismatch` (a weight-sync model was
   invalid: nothing was applied) or :class:`InvalidRequest`; anything else is a
   :class:`FarEngineError` carrying the far traceback. A channel that fails (dead process, lost
   actor, unreachable server, no answer in time) raises :class:`EngineUnavailable`.
5. **One partial-failure rule** for engines with several workers (:func:`raise_for_workers`): the
   first failure's type, except that a weight update some workers applied and others did not is
   :class:`WeightsInvalidated` (a :class:`ManifestMismatch` is checked before anything is applied,
   so it stays itself).
6. **Streams** cross as a cursor (:meth:`EngineHost` ``_stream_open`` / ``_stream_next`` /
   ``_stream_close``): the far side buffers at most ``stream_buffer`` deltas and produces no
   further than the caller consumes. The caller names the stream (``sid``) when it opens it and
   closes it whatever happened unless it read the end, so a caller cancelled while the open was
   on its way still ends the far stream (a close that arrives first makes the open refused). A
   far stream nobody polled for :data:`STREAM_IDLE_S` is ended (a caller that vanished). A
   channel with a native stream (HTTP server-sent events) overrides :meth:`Channel.stream`.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import importlib
import inspect
import itertools
import logging
import sys
import time
import traceback
import typing
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .engine import INIT_GRACE_S, Capabilities, EngineProtocol
from .errors import (
    CapabilityError,
    EngineClosed,
    EngineUnavailable,
    InvalidRequest,
    ManifestMismatch,
    RolloutEnginesError,
    WeightsInvalidated,
    WeightSyncError,
)
from .types import Completion, Diagnostics, EngineConfig, EngineInfo, GenerateRequest, PauseMode, StreamDelta
from .weights import manifest as manifest_module
from .weights.manifest import TransportSpec, WeightManifest, manifest_from_wire, manifest_to_wire

logger = logging.getLogger("rollout_engines.proxy")

#: Seconds a weight call may take beyond its own ``timeout_s`` before the proxy gives up on the far side.
WEIGHT_MARGIN_S = 60.0
#: Seconds a far stream waits for a delta before it answers "nothing yet" (the caller asks again).
STREAM_POLL_S = 10.0
#: Seconds a far stream may go without being polled before the host ends it (its caller is gone;
#: long enough for a consumer that holds a delta while it does other work).
STREAM_IDLE_S = 60 * STREAM_POLL_S
#: Stream ids closed before they were opened that a host remembers (their late open is refused).
_CLOSED_EARLY_KEPT = 1024


# ---- the error wire format ----------------------------------------------------------------------
class FarEngineError(RolloutEnginesError, RuntimeError):
    """The far engine raised an error that is none of ours and no builtin; ``far_type`` names it and
    the message ends with the far traceback."""

    far_type: str = ""


class WireError(BaseModel):
    """An exception on its way from the far engine (or one of its workers) to the caller.

    Also accepts the older ``{"error": TYPE, "message": ...}`` shape of worker results and the
    ``{"type", "message", "param"}`` body of the server's error responses.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: str = Field(validation_alias=AliasChoices("type", "error"), description="Class name.")
    module: str = Field(default="", description="Module of the class ('' when the sender did not say).")
    message: str = ""
    peer: str | None = None
    bucket: int | None = None
    param: str | None = Field(default=None, description="The offending field, dotted, when there is one.")
    attrs: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict, description="Plain instance attributes of the exception, restored on rebuild.")
    traceback: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> WireError:
        """The wire form of ``exc`` (a pydantic ``ValidationError`` already as the typed error)."""
        exc = typed_validation_error(exc)
        attrs = {k: v for k, v in vars(exc).items()
                 if isinstance(v, str | int | float | bool | type(None)) and not k.startswith("_")}
        return cls(
            type=type(exc).__name__, module=type(exc).__module__, message=str(exc),
            peer=getattr(exc, "peer", None), bucket=getattr(exc, "bucket", None),
            param=getattr(exc, "param", None), attrs=attrs,
            traceback="".join(traceback.format_exception(exc))[-8000:],
        )

    def to_exception(self, where: str = "") -> Exception:
        """The same exception class where it is one of ours or a builtin, else :class:`FarEngineError`."""
        cls = _error_class(self.type, self.module)
        if cls is None:
            detail = f"\n{self.traceback}" if self.traceback else ""
            far = FarEngineError(f"{where or 'the far engine'} raised {self.type}: {self.message}{detail}")
            far.far_type = self.type
            return far
        exc = cls.__new__(cls)
        exc.args = (self.message,)
        try:
            vars(exc).update(self.attrs)
            if issubclass(cls, WeightSyncError):
                exc.peer, exc.bucket = self.peer, self.bucket  # type: ignore[attr-defined]
        except TypeError:  # a builtin without a __dict__
            pass
        return exc


def typed_validation_error(exc: BaseException) -> BaseException:
    """A pydantic ``ValidationError`` as the typed error it means: a weight-sync model (manifest,
    transport spec) -> :class:`ManifestMismatch`, anything else (a request) -> :class:`InvalidRequest`.
    Other exceptions are returned as they are."""
    if not isinstance(exc, ValidationError):
        return exc
    cls = ManifestMismatch if exc.title in _WEIGHT_MODELS else InvalidRequest
    typed = cls(f"invalid {exc.title}: {exc}")
    typed.__cause__ = exc
    return typed


_WEIGHT_MODELS = frozenset(
    name for name, value in vars(manifest_module).items() if isinstance(value, type) and issubclass(value, BaseModel)
)


def _error_class(name: str, module: str) -> type[Exception] | None:
    if name == "ValidationError" and module in ("", "pydantic_core._pydantic_core", "pydantic"):
        return InvalidRequest  # the server's name for a request that failed validation
    from . import errors as core_errors

    candidates: list[Any] = []
    if module.startswith("rollout_engines") and module in sys.modules:
        candidates.append(sys.modules[module])  # ours, already imported (never import by wire name)
    if module in ("", "rollout_engines.errors") or module.startswith("rollout_engines"):
        candidates.append(core_errors)
    if module in ("", "builtins"):
        candidates.append(builtins)
    for where in candidates:
        cls = getattr(where, name, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls
    return None


def raise_for_workers(results: Sequence[Mapping[str, Any] | None], what: str, *, applies_weights: bool,
                      worker: str = "worker") -> None:
    """The one rule for a call that ran on every worker of an engine (``results``: one per worker,
    ``None`` or ``{"ok": True, ...}`` for success, else a :class:`WireError` dict; ``worker`` names
    them in messages).

    Raises the first failure as its own type when that is a :class:`WeightSyncError` or a
    :class:`CapabilityError` (a worker that cannot do it), else as a ``WeightSyncError`` naming
    it. ``applies_weights``: workers that succeeded while others failed leave mismatched shards,
    so the error is :class:`WeightsInvalidated` (a :class:`ManifestMismatch` is raised before
    anything is applied and stays itself).
    """
    failed = [(rank, r) for rank, r in enumerate(results) if r is not None and not r.get("ok", False)]
    if not failed:
        return
    rank, first = failed[0]
    wire = WireError.model_validate(first)
    exc = wire.to_exception(f"{worker} {rank}")
    if not isinstance(exc, WeightSyncError | CapabilityError):  # a refusal stays one (the sender stops waiting)
        exc = WeightSyncError(f"{what} failed in {worker} {rank}: {wire.type}: {wire.message}",
                              peer=wire.peer, bucket=wire.bucket)
    applied = [i for i, r in enumerate(results) if r is None or r.get("ok", False)]
    if applies_weights and applied and not isinstance(exc, ManifestMismatch):
        invalid = WeightsInvalidated(f"{exc} (workers {applied} applied it)")
        invalid.peer, invalid.bucket = getattr(exc, "peer", None), getattr(exc, "bucket", None)
        exc = invalid
    raise exc


# ---- wire values from the protocol's signatures ------------------------------------------------
class _Codec:
    """Encodes one type to a plain (JSON-able) value and back, validating on the way in."""

    def __init__(self, hint: Any) -> None:
        self.manifest = hint is WeightManifest
        self.adapter: TypeAdapter[Any] | None = None if hint in (None, type(None)) else TypeAdapter(hint)

    def encode(self, value: Any) -> Any:
        if self.manifest:
            return manifest_to_wire(value)  # the tensor layout is cached between pushes
        return value if self.adapter is None else self.adapter.dump_python(value, mode="json")

    def decode(self, value: Any) -> Any:
        if self.manifest:
            return manifest_from_wire(value) if "layout" in value else WeightManifest.model_validate(value)
        return value if self.adapter is None else self.adapter.validate_python(value)


class _Signature:
    def __init__(self, name: str) -> None:
        fn = getattr(EngineProtocol, name)
        hints = typing.get_type_hints(fn, vars(sys.modules[EngineProtocol.__module__]))
        self.params = {p: _Codec(hints[p]) for p in inspect.signature(fn).parameters if p != "self"}
        ret = hints.get("return")
        self.streams = typing.get_origin(ret) in (AsyncIterator, AsyncGenerator)
        self.result = _Codec(typing.get_args(ret)[0] if self.streams else ret)


SIGNATURES: dict[str, _Signature] = {name: _Signature(name) for name in EngineProtocol.methods()}


# ---- the far side ------------------------------------------------------------------------------
class EngineHost:
    """Serves one :class:`Engine` to a channel: wire values in, wire values (or exceptions) out.

    Besides the protocol's methods it answers ``describe`` and the stream cursor
    (``_stream_open``, ``_stream_next``, ``_stream_close``). ``stream_buffer``: deltas a far
    stream holds for its caller; ``stream_idle_s``: a far stream not polled for this long is ended.
    """

    def __init__(self, engine: EngineProtocol, *, stream_buffer: int = 64,
                 stream_idle_s: float = STREAM_IDLE_S) -> None:
        self.engine = engine
        self.stream_buffer = stream_buffer
        self.stream_idle_s = stream_idle_s
        self._streams: dict[str, _FarStream] = {}
        self._ids = itertools.count()
        # ids closed before their open arrived (the caller gave up while it was on its way)
        self._closed_early: dict[str, None] = {}
        self._reaper: asyncio.Task[None] | None = None

    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {"backend": e.backend_name, "capabilities": e.capabilities.model_dump(mode="json"),
                "weight_receivers": e.weight_receivers(), "weight_version": e.weight_version,
                "loras": dict(e.loras)}

    async def call(self, method: str, args: Mapping[str, Any]) -> Any:
        """Run ``method`` with wire ``args``; returns the wire result or raises the engine's error."""
        if method == "describe":
            return self.describe()
        if method == "_stream_open":
            return self._open(args)
        if method == "_stream_next":
            return await self._next(str(args["sid"]))
        if method == "_stream_close":
            await self._close_stream(str(args["sid"]))
            return None
        sig = SIGNATURES.get(method)
        if sig is None or sig.streams:
            raise ValueError(f"unknown engine call '{method}'")
        kwargs = {name: codec.decode(args[name]) for name, codec in sig.params.items() if name in args}
        if method == "close":
            await self._close_streams()
        return sig.result.encode(await getattr(self.engine, method)(**kwargs))

    async def reply(self, method: str, args: Mapping[str, Any]) -> tuple[bool, Any]:
        """:meth:`call` for channels that carry values, not exceptions: ``(True, result)`` or
        ``(False, WireError dict)``."""
        try:
            return True, await self.call(method, args)
        except BaseException as exc:  # every failure travels back to the caller
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
            return False, WireError.of(exc).model_dump()

    def _open(self, args: Mapping[str, Any]) -> str:
        """Open the stream the caller named ``sid`` (older callers name none: one is made here)."""
        request = SIGNATURES["stream"].params["request"].decode(args["request"])
        sid = str(args.get("sid") or f"s{next(self._ids)}")
        if sid in self._closed_early:
            del self._closed_early[sid]
            raise EngineClosed(f"stream '{sid}' was closed by its caller before it opened")
        if sid in self._streams:
            raise InvalidRequest(f"stream id '{sid}' is already open; use a new id for each stream")
        self._streams[sid] = _FarStream(self.engine.stream(request), self.stream_buffer)
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())
        return sid

    async def _next(self, sid: str) -> dict[str, Any]:
        stream = self._streams.get(sid)
        if stream is None:
            raise ValueError(f"no open stream '{sid}' (finished, closed, not polled for "
                             f"{self.stream_idle_s:.0f} s, or the engine was restarted)")
        stream.polling += 1
        try:
            items, done = await stream.take(STREAM_POLL_S)
        except BaseException:
            self._streams.pop(sid, None)
            raise
        finally:
            stream.polling -= 1
            stream.polled = time.monotonic()
        if done:
            self._streams.pop(sid, None)
        return {"items": items, "done": done}

    async def _close_stream(self, sid: str) -> None:
        stream = self._streams.pop(sid, None)
        if stream is not None:
            await stream.cancel()
            return
        # Not open (yet): its open may still be on its way; refuse it when it comes.
        self._closed_early[sid] = None
        while len(self._closed_early) > _CLOSED_EARLY_KEPT:
            del self._closed_early[next(iter(self._closed_early))]

    async def _close_streams(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for sid in list(self._streams):
            await self._close_stream(sid)

    async def _reap(self) -> None:
        """End far streams whose caller stopped polling (a safety net: callers close their own)."""
        while self._streams:
            await asyncio.sleep(min(STREAM_POLL_S, self.stream_idle_s))
            now = time.monotonic()
            for sid, stream in list(self._streams.items()):
                if not stream.polling and now - stream.polled > self.stream_idle_s:
                    logger.warning("stream '%s' was not polled for %.0f s: ending it", sid, self.stream_idle_s)
                    if self._streams.pop(sid, None) is stream:
                        await stream.cancel()


class _FarStream:
    """One ``engine.stream`` run by a task into a bounded queue (the engine waits while it is full)."""

    _END = object()

    def __init__(self, deltas: AsyncIterator[StreamDelta], buffer: int) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=max(1, buffer))
        self.buffer = max(1, buffer)
        self.polling = 0  # _stream_next calls waiting on it now
        self.polled = time.monotonic()  # when the last one ended (or the stream opened)
        self.task = asyncio.ensure_future(self._run(deltas))

    async def _run(self, deltas: AsyncIterator[StreamDelta]) -> None:
        try:
            async for delta in deltas:
                await self.queue.put(delta.model_dump(mode="json"))
        except BaseException as exc:  # delivered to the reader
            if isinstance(exc, asyncio.CancelledError):
                raise
            await self.queue.put(_Failure(exc))
        else:
            await self.queue.put(self._END)
        finally:
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()

    async def take(self, wait_s: float) -> tuple[list[Any], bool]:
        items: list[Any] = []
        try:
            first = await asyncio.wait_for(self.queue.get(), wait_s)
        except asyncio.TimeoutError:
            return items, False
        pending = [first]
        while len(pending) < self.buffer and not self.queue.empty():
            pending.append(self.queue.get_nowait())
        for item in pending:
            if item is self._END:
                return items, True
            if isinstance(item, _Failure):
                raise item.exc
            items.append(item)
        return items, False

    async def cancel(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except BaseException:  # cancelled on purpose
            pass


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def load_factory(factory: str | None) -> Callable[[EngineConfig], EngineProtocol]:
    """``"pkg.module:callable"`` that builds an engine from its config (default :func:`create_engine`)."""
    if factory is None:
        from .factory import create_engine

        return create_engine
    module, _, attr = factory.partition(":")
    return typing.cast(Callable[[EngineConfig], EngineProtocol], getattr(importlib.import_module(module), attr))


# ---- the near side -----------------------------------------------------------------------------
class Channel(abc.ABC):
    """One way of reaching a far :class:`EngineHost`: send a call, get its wire result back.

    ``call`` raises the far engine's error rebuilt from its :class:`WireError` and
    :class:`EngineUnavailable` when the channel itself fails or ``timeout_s`` passes.
    """

    #: Names the far side in messages ("the engine process (pid 12)", "http://host:8000").
    label: str = "the far engine"

    @abc.abstractmethod
    async def call(self, method: str, args: dict[str, Any], timeout_s: float | None) -> Any: ...

    async def stream(self, request: Any, timeout_s: float | None) -> AsyncIterator[Any]:
        """Wire deltas of ``engine.stream(request)``, by the far host's cursor. The stream's id is
        chosen here, so it can be closed even if this caller is cancelled while opening it."""
        sid = uuid.uuid4().hex
        done = False
        try:
            sid = str(await self.call("_stream_open", {"request": request, "sid": sid}, timeout_s) or sid)
            while not done:
                out = await self.call("_stream_next", {"sid": sid}, timeout_s)
                done = bool(out["done"])
                for item in out["items"]:
                    yield item
        finally:
            if not done:  # the caller stopped early (or the open or the far side failed): end the far stream
                try:
                    await self.call("_stream_close", {"sid": sid}, 30.0)
                except Exception:
                    logger.debug("%s: closing stream %s failed", self.label, sid, exc_info=True)

    async def aclose(self) -> None:
        """Release the channel (after the far engine was asked to close, where it is ours to close)."""
        return None


async def bounded(awaitable: typing.Awaitable[Any], timeout_s: float | None, label: str, method: str) -> Any:
    """``awaitable`` within ``timeout_s``, else :class:`EngineUnavailable` naming the call."""
    if timeout_s is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise EngineUnavailable(f"{label} did not answer {method}() within {timeout_s:.0f} s") from None


class LocalChannel(Channel):
    """An engine in this process behind the same wire values and error format (the ``remote``
    backend's plain-server adapters are engines of this kind)."""

    def __init__(self, engine: EngineProtocol, label: str | None = None) -> None:
        self.host = EngineHost(engine)
        self.label = label or f"engine '{engine.backend_name}'"

    async def call(self, method: str, args: dict[str, Any], timeout_s: float | None) -> Any:
        try:
            return await bounded(self.host.call(method, args), timeout_s, self.label, method)
        except EngineUnavailable:
            raise
        except Exception as exc:
            raise WireError.of(exc).to_exception(self.label) from exc


def declared(capabilities: Mapping[str, Any]) -> Capabilities:
    """The far engine's capabilities as seen from another process (rule 2 of the module docstring)."""
    known = {k: v for k, v in capabilities.items() if k in Capabilities.model_fields}
    known["multi_process"] = True
    known["transports"] = tuple(t for t in known.get("transports", ()) if t != "inproc")
    return Capabilities(**known)


class ProxyEngine(EngineProtocol):
    """Forwards every method of :class:`EngineProtocol` over ``channel`` (see the module docstring).

    ``described``: the far engine's :meth:`EngineHost.describe` (``backend``, ``capabilities``,
    ``weight_receivers``, ``weight_version``), fetched when the channel connected.
    ``call_timeout_s`` bounds every call but the weight calls (bounded by their own ``timeout_s``
    plus :data:`WEIGHT_MARGIN_S`) and ``health`` (``health_timeout_s``, then it answers False).
    """

    def __init__(self, channel: Channel, config: EngineConfig, described: Mapping[str, Any], *,
                 call_timeout_s: float | None = 3600.0, health_timeout_s: float = 30.0,
                 backend_name: str | None = None) -> None:
        self.channel = channel
        self.config = config
        self.call_timeout_s = call_timeout_s
        self.health_timeout_s = health_timeout_s
        # The far engine's name (or the proxy's own, e.g. "remote"), known only once connected.
        self.backend_name = backend_name or str(described.get("backend", "?"))  # type: ignore[misc]
        self._closed = False
        self.described: dict[str, Any] = {}
        self._apply(described)

    def _apply(self, described: Mapping[str, Any]) -> None:
        self.described = dict(described)
        self.capabilities: Capabilities = declared(described.get("capabilities") or {})
        self._receivers = int(described.get("weight_receivers", 1))
        self.weight_version = int(described.get("weight_version", 0))
        self.loras: dict[str, int] = {str(k): int(v) for k, v in (described.get("loras") or {}).items()}

    @property
    def closed(self) -> bool:
        return self._closed

    def weight_receivers(self) -> int:
        return self._receivers

    async def _call(self, method: str, timeout_s: float | None = None, **args: Any) -> Any:
        if self._closed:
            raise EngineClosed(f"engine '{self.backend_name}' is closed; create a new one")
        sig = SIGNATURES[method]
        wire = {name: sig.params[name].encode(value) for name, value in args.items()}
        out = await self.channel.call(method, wire, timeout_s if timeout_s is not None else self.call_timeout_s)
        return sig.result.decode(out)

    # ---- the protocol, forwarded (one line each; tests/test_proxies.py checks every one) ---------
    async def generate(self, request: GenerateRequest) -> list[Completion]:
        return typing.cast(list[Completion], await self._call("generate", request=request))

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        if self._closed:
            raise EngineClosed(f"engine '{self.backend_name}' is closed; create a new one")
        codec = SIGNATURES["stream"]
        wire = codec.params["request"].encode(request)
        async for item in self.channel.stream(wire, self.call_timeout_s):
            yield codec.result.decode(item)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._call("abort", request_ids=list(request_ids))

    async def abort_all(self) -> None:
        await self._call("abort_all")

    async def chat(self, request: GenerateRequest) -> list[Completion]:
        return typing.cast(list[Completion], await self._call("chat", request=request))

    async def sleep(self, level: int = 1, tags: Sequence[str] | None = None) -> None:
        await self._call("sleep", level=level, tags=None if tags is None else list(tags))

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        await self._call("wake_up", tags=None if tags is None else list(tags))

    async def reset_prefix_cache(self) -> None:
        await self._call("reset_prefix_cache")

    async def pause(self, mode: PauseMode = "wait") -> None:
        """As :meth:`Engine.pause <rollout_engines.engine.Engine.pause>` on the far engine. In flight
        means the far engine has the request (``info().outstanding`` counts it): a call started here
        just before the pause that reaches the far side after it is held there until :meth:`resume`."""
        await self._call("pause", mode=mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def init_weight_transfer(self, spec: TransportSpec) -> None:
        await self._call("init_weight_transfer", spec.timeout_s + INIT_GRACE_S + WEIGHT_MARGIN_S, spec=spec)

    async def receive_weights(self, manifest: WeightManifest) -> int:
        version = int(await self._call("receive_weights", manifest.timeout_s + WEIGHT_MARGIN_S, manifest=manifest))
        if manifest.lora is not None:
            self.loras[manifest.lora.name] = version
        else:
            self.weight_version = version
        return version

    async def unload_lora(self, name: str) -> bool:
        unloaded = bool(await self._call("unload_lora", name=name))
        self.loras.pop(name, None)
        return unloaded

    async def close_weight_transfer(self) -> None:
        if not self._closed:
            await self._call("close_weight_transfer")

    async def info(self) -> EngineInfo:
        info: EngineInfo = await self._call("info")
        self.weight_version = info.weight_version
        self.loras = dict(info.loras)
        # As seen from here: this proxy's name, configuration and declared capabilities.
        return info.model_copy(update={"backend": self.backend_name, "model": self.config.model,
                                       "capabilities": self.capabilities.model_dump()})

    async def health(self) -> bool:
        """False when closed, when the far engine says so, or when it does not answer in time."""
        if self._closed:
            return False
        try:
            return bool(await self._call("health", self.health_timeout_s))
        except RolloutEnginesError:
            return False

    async def diagnostics(self, fingerprint: bool = False) -> Diagnostics:
        return typing.cast(Diagnostics, await self._call("diagnostics", fingerprint=fingerprint))

    async def close(self) -> None:
        """Close the far engine (where the channel owns it) and the channel. Idempotent."""
        if self._closed:
            return
        try:
            await self._call("close", 60.0)
        except Exception as exc:
            logger.debug("%s: close failed (%r)", self.channel.label, exc)
        finally:
            self._closed = True
            try:
                await self.channel.aclose()
            finally:
                from .plugins import get_registry

                get_registry().hooks.engine_closed(engine=self)
