"""``ProcessEngine``: any backend hosted in a child process, driven over a pipe.

    engine = ProcessEngine(EngineConfig(backend="transformers", model=path))
    outs = await engine.generate(request)        # runs in the child
    sync = await connect_weight_sync([engine], transport="shm")   # the child receives

The child is started with ``multiprocessing``'s *spawn* method (no inherited threads or CUDA
state), builds the engine with :func:`create_engine` (or ``factory="pkg.mod:callable"`` taking an
:class:`EngineConfig`) and serves the engine protocol: requests and results cross the pipe as
plain dicts of the pydantic models. Errors come back as the same types (``WeightSyncError``,
``EngineAsleep``, ...). Every call has a timeout, and if the child dies every pending and later
call raises :class:`EngineUnavailable` with its exit code. This is how a trainer runs an engine
out of its process without Ray, and how the tests put trainer and engine in different processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import itertools
import logging
import multiprocessing as mp
import threading
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from .engine import Capabilities, Engine
from .errors import EngineUnavailable, RolloutEnginesError
from .types import Completion, EngineConfig, EngineInfo, GenerateRequest, PauseMode
from .weights.manifest import TransportSpec, WeightManifest, manifest_from_wire, manifest_to_wire

logger = logging.getLogger("rollout_engines.process")


class ProcessEngine(Engine):
    """Hosts an engine of ``config.backend`` in a child process and proxies the engine protocol.

    ``factory``: optional ``"pkg.module:callable"`` that builds the engine from an
    :class:`EngineConfig` in the child (default: :func:`rollout_engines.create_engine`).
    ``start_timeout_s`` bounds start-up (model load); ``call_timeout_s`` bounds every other call
    (a weight update is bounded by its manifest's ``timeout_s`` plus a margin instead).
    """

    backend_name = "process"
    # The hosted engine applies the core's cache rules in its own process (after a wake-up and
    # after every update): one round trip fewer per push.
    resets_cache_itself = True

    def __init__(
        self,
        config: EngineConfig,
        *,
        factory: str | None = None,
        start_timeout_s: float = 600.0,
        call_timeout_s: float = 3600.0,
    ) -> None:
        super().__init__(config)
        self.call_timeout_s = call_timeout_s
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        # Not a daemon: the hosted engine may start processes of its own (vLLM workers).
        self._proc = ctx.Process(
            target=_child_main, args=(child, config.model_dump(), factory), name=f"roe-engine-{config.backend}"
        )
        self._proc.start()
        child.close()
        self._conn: Connection = parent
        self._send_lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count()
        self._dead: str | None = None
        if not parent.poll(start_timeout_s):
            self._kill()
            raise EngineUnavailable(f"engine process did not start within {start_timeout_s:.0f} s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineUnavailable(
                f"engine process exited during start-up (exit code {self._proc.exitcode})"
            ) from None
        if kind != "ready":
            self._proc.join(5)
            raise _rebuild(payload)
        self.backend_name = payload["backend"]  # type: ignore[misc]  # the hosted backend's name
        self.capabilities = Capabilities(**{**payload["capabilities"], "multi_process": True})
        self._receivers = int(payload["receivers"])
        self.pid = self._proc.pid
        self._reader = threading.Thread(target=self._read, name="roe-process-engine-reader", daemon=True)
        self._reader.start()

    # ---- plumbing ------------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                call_id, ok, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            fut = self._pending.pop(call_id, None)
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(payload)
                else:
                    fut.set_exception(_rebuild(payload))
        self._proc.join(5)
        if not self._closed:
            self._dead = f"the engine process (pid {self._proc.pid}) exited with code {self._proc.exitcode}"
            logger.warning("%s", self._dead)
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(EngineUnavailable(self._dead or "the engine process is closed"))
        self._pending.clear()

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        if self._dead:
            raise EngineUnavailable(f"{self._dead}; create a new engine")
        call_id = next(self._ids)
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._pending[call_id] = fut
        try:
            with self._send_lock:
                self._conn.send((call_id, method, args))
        except (OSError, ValueError) as exc:
            self._pending.pop(call_id, None)
            raise EngineUnavailable(f"the engine process is gone ({exc}); create a new engine") from exc
        timeout = timeout_s if timeout_s is not None else self.call_timeout_s
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            self._pending.pop(call_id, None)
            raise EngineUnavailable(
                f"the engine process did not answer {method}() within {timeout:.0f} s"
            ) from None

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5)

    # ---- engine hooks --------------------------------------------------------------------------
    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        out = await self._call("generate", request.model_dump())
        return [Completion(**c) for c in out]

    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        await self._call("sleep", level, list(tags))

    async def _wake_up(self, tags: Sequence[str]) -> None:
        await self._call("wake_up", list(tags))

    async def _reset_prefix_cache(self) -> None:
        await self._call("reset_prefix_cache")

    async def _pause(self, mode: PauseMode) -> None:
        await self._call("pause", mode)

    async def _resume(self) -> None:
        await self._call("resume")

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        await self._call("init_weight_transfer", spec.model_dump(), timeout_s=spec.timeout_s + 30)

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        await self._call("receive_weights", manifest_to_wire(manifest), timeout_s=manifest.timeout_s + 30)

    async def _close_weight_transfer(self) -> None:
        if not self._dead and not self._closed:
            await self._call("close_weight_transfer")

    def weight_receivers(self) -> int:
        return self._receivers

    async def info(self) -> EngineInfo:
        if self._closed or self._dead:
            return await super().info()
        info = EngineInfo(**await self._call("info"))
        info.capabilities = self.capabilities.model_dump()  # as seen from here (multi_process)
        return info

    async def health(self) -> bool:
        if self._closed or self._dead or not self._proc.is_alive():
            return False
        try:
            return bool(await self._call("health", timeout_s=30))
        except RolloutEnginesError:
            return False

    async def _close(self) -> None:
        try:
            if not self._dead and self._proc.is_alive():
                await self._call("close", timeout_s=60)
        except Exception:
            logger.debug("closing the engine process failed; killing it", exc_info=True)
        finally:
            self._conn.close()
            await asyncio.to_thread(self._proc.join, 10)
            self._kill()


# ---- child side -------------------------------------------------------------------------------
def _error_payload(exc: BaseException) -> dict[str, Any]:
    attrs = {k: v for k, v in vars(exc).items() if isinstance(v, str | int | float | bool | type(None))}
    return {
        "module": type(exc).__module__, "qualname": type(exc).__qualname__, "message": str(exc),
        "attrs": attrs, "traceback": "".join(traceback.format_exception(exc)),
    }


def _rebuild(payload: dict[str, Any]) -> BaseException:
    """The child's exception as the same type where it is ours or a builtin, else a RuntimeError."""
    module, qualname, message = payload["module"], payload["qualname"], payload["message"]
    cls: Any = None
    if module == "builtins" or module.startswith("rollout_engines") or module.startswith("pydantic"):
        try:
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except Exception:
            cls = None
    if isinstance(cls, type) and issubclass(cls, Exception) and not module.startswith("pydantic"):
        exc = cls.__new__(cls)
        exc.args = (message,)
        try:
            vars(exc).update(payload["attrs"])
        except TypeError:
            pass
        return exc
    return RuntimeError(f"engine process raised {qualname}: {message}\n{payload['traceback']}")


def _load_factory(factory: str | None) -> Any:
    if factory is None:
        from .factory import create_engine

        return create_engine
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)


def _child_main(conn: Connection, config: dict[str, Any], factory: str | None) -> None:
    logging.basicConfig(level=logging.WARNING)
    try:
        engine: Engine = _load_factory(factory)(EngineConfig(**config))
    except BaseException as exc:
        conn.send(("error", _error_payload(exc)))
        conn.close()
        return
    conn.send(("ready", {
        "backend": engine.backend_name, "capabilities": engine.capabilities.model_dump(),
        "receivers": engine.weight_receivers(),
    }))
    asyncio.run(_serve(conn, engine))


async def _serve(conn: Connection, engine: Engine) -> None:
    loop = asyncio.get_running_loop()
    send_lock = threading.Lock()
    stopped = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    def reply(call_id: int, ok: bool, payload: Any) -> None:
        with send_lock:
            try:
                conn.send((call_id, ok, payload))
            except (OSError, ValueError):
                pass  # the parent is gone; nothing to answer

    async def handle(call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            result = await _dispatch(engine, method, args)
        except BaseException as exc:
            reply(call_id, False, _error_payload(exc))
        else:
            reply(call_id, True, result)
        if method == "close":
            stopped.set()

    def start(call_id: int, method: str, args: tuple[Any, ...]) -> None:
        task = loop.create_task(handle(call_id, method, args))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def read() -> None:
        # In the event loop itself (no reader thread to wake, then the loop): a call starts one
        # thread hop sooner. The parent reads on a thread of its own, so while this loop writes
        # a large reply the parent drains it and the two never block on each other.
        try:
            while conn.poll():
                call_id, method, args = conn.recv()
                start(call_id, method, args)
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            stopped.set()  # the parent died or closed the pipe: shut the engine down

    loop.add_reader(conn.fileno(), read)
    await stopped.wait()
    with contextlib.suppress(Exception):
        loop.remove_reader(conn.fileno())
    if not engine.closed:
        try:
            await asyncio.wait_for(engine.close(), 60)
        except Exception:
            logger.exception("closing the engine failed")


async def _dispatch(engine: Engine, method: str, args: tuple[Any, ...]) -> Any:
    if method == "generate":
        return [c.model_dump() for c in await engine.generate(GenerateRequest(**args[0]))]
    if method == "init_weight_transfer":
        return await engine.init_weight_transfer(TransportSpec(**args[0]))
    if method == "receive_weights":
        return await engine.receive_weights(manifest_from_wire(args[0]))
    if method == "info":
        return (await engine.info()).model_dump()
    if method in ("sleep", "wake_up", "reset_prefix_cache", "pause", "resume", "close_weight_transfer",
                  "health", "close"):
        return await getattr(engine, method)(*args)
    raise ValueError(f"unknown engine call '{method}'")
