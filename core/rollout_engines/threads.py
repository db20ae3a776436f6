"""Blocking work off the event loop, on threads of its own.

``asyncio.to_thread`` shares one small executor (``min(32, cores + 4)`` threads): a few blocking
calls that wait on a peer (a weight-sync rendezvous that never answers) would take every thread and
stall unrelated work that needs the executor. Calls that may wait on another process use
:func:`run_in_thread` instead: one daemon thread per call, so they never starve anything else.
Every such call must still be bounded by its own timeout.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def run_in_thread(fn: Callable[..., T], *args: Any, name: str = "roe-blocking") -> T:
    """Run ``fn(*args)`` on a new daemon thread and await its result (its exception is raised)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def body() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, False, exc)
        else:
            loop.call_soon_threadsafe(settle, True, result)

    threading.Thread(target=body, name=name, daemon=True).start()
    return await future
