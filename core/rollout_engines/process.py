"""``ProcessEngine``: any backend hosted in a child process, driven over a pipe.

    engine = ProcessEngine(EngineConfig(backend="transformers", model=path))
    outs = await engine.generate(request)        # runs in the child
    sync = await connect_weight_sync([engine], transport="shm")   # the child receives

The child is started with ``multiprocessing``'s *spawn* method (no inherited threads or CUDA
state), builds the engine with :func:`create_engine` (or ``factory="pkg.mod:callable"`` taking an
:class:`EngineConfig`) and serves it with an :class:`~rollout_engines.proxy.EngineHost`. This side
is a :class:`~rollout_engines.proxy.ProxyEngine` over a :class:`PipeChannel`: the proxy's rules
(errors as the same types, capabilities fetched at start, streams by cursor) are written once in
:mod:`rollout_engines.proxy`. Every call has a timeout, and if the child dies every pending and later
call raises :class:`EngineUnavailable` with its exit code. This is how a trainer runs an engine
out of its process without Ray, and how the tests put trainer and engine in different processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from typing import Any

from .errors import EngineUnavailable
from .proxy import Channel, EngineHost, ProxyEngine, WireError, bounded, load_factory
from .types import EngineConfig

logger = logging.getLogger("rollout_engines.process")


class PipeChannel(Channel):
    """The parent's end of the pipe to an engine's child process (see :class:`ProcessEngine`).

    Messages: ``(call_id, method, args)`` to the child, ``(call_id, ok, payload)`` back, where
    ``payload`` is the wire result or a :class:`WireError` dict. A reader thread matches answers
    to calls, so large answers never block the child.
    """

    def __init__(self, config: EngineConfig, factory: str | None, start_timeout_s: float) -> None:
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
        self._closing = False
        self.pid = self._proc.pid
        self.label = f"the engine process (pid {self.pid})"
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
            raise WireError.model_validate(payload).to_exception(self.label)
        self.described: dict[str, Any] = payload
        self._reader = threading.Thread(target=self._read, name="roe-process-engine-reader", daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

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
                    fut.set_exception(WireError.model_validate(payload).to_exception(self.label))
        self._proc.join(5)
        if not self._closing:
            self._dead = f"{self.label} exited with code {self._proc.exitcode}"
            logger.warning("%s", self._dead)
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(EngineUnavailable(self._dead or f"{self.label} is closed"))
        self._pending.clear()

    async def call(self, method: str, args: dict[str, Any], timeout_s: float | None) -> Any:
        if self._dead:
            raise EngineUnavailable(f"{self._dead}; create a new engine")
        if method == "close" and not self._proc.is_alive():
            return None
        if method == "close":
            self._closing = True
        call_id = next(self._ids)
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._pending[call_id] = fut
        try:
            with self._send_lock:
                self._conn.send((call_id, method, args))
        except (OSError, ValueError) as exc:
            self._pending.pop(call_id, None)
            raise EngineUnavailable(f"{self.label} is gone ({exc}); create a new engine") from exc
        try:
            return await bounded(asyncio.wrap_future(fut), timeout_s, self.label, method)
        finally:
            self._pending.pop(call_id, None)

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5)

    async def aclose(self) -> None:
        self._closing = True
        self._conn.close()
        await asyncio.to_thread(self._proc.join, 10)
        self._kill()


class ProcessEngine(ProxyEngine):
    """Hosts an engine of ``config.backend`` in a child process and proxies the engine protocol.

    ``factory``: optional ``"pkg.module:callable"`` that builds the engine from an
    :class:`EngineConfig` in the child (default: :func:`rollout_engines.create_engine`).
    ``start_timeout_s`` bounds start-up (model load); ``call_timeout_s`` bounds every other call
    (a weight update is bounded by its manifest's ``timeout_s`` plus a margin instead).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        factory: str | None = None,
        start_timeout_s: float = 600.0,
        call_timeout_s: float = 3600.0,
    ) -> None:
        channel = PipeChannel(config, factory, start_timeout_s)
        super().__init__(channel, config, channel.described, call_timeout_s=call_timeout_s)
        self.pipe = channel
        self.pid = channel.pid

    async def health(self) -> bool:
        return self.pipe.alive() and await super().health()


# ---- child side -------------------------------------------------------------------------------
def _child_main(conn: Connection, config: dict[str, Any], factory: str | None) -> None:
    logging.basicConfig(level=logging.WARNING)
    try:
        host = EngineHost(load_factory(factory)(EngineConfig(**config)))
    except BaseException as exc:
        conn.send(("error", WireError.of(exc).model_dump()))
        conn.close()
        return
    conn.send(("ready", host.describe()))
    asyncio.run(_serve(conn, host))


async def _serve(conn: Connection, host: EngineHost) -> None:
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

    async def handle(call_id: int, method: str, args: dict[str, Any]) -> None:
        ok, payload = await host.reply(method, args)
        reply(call_id, ok, payload)
        if method == "close":
            stopped.set()

    def start(call_id: int, method: str, args: dict[str, Any]) -> None:
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
    if not host.engine.closed:
        try:
            await asyncio.wait_for(host.engine.close(), 60)
        except Exception:
            logger.exception("closing the engine failed")
