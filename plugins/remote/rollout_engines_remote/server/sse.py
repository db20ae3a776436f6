"""Server-sent events: a response that pulls its events only as the client reads them, and closes
its source (and so the engine's stream, which cancels the generation) when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from rollout_engines.errors import RolloutEnginesError

from ..protocol import ERROR_STATUS
from .errors import FieldError, error_body
from .state import cancel_on_disconnect

logger = logging.getLogger("rollout_engines.remote.server")
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
_END = object()


def event(data: str | bytes) -> bytes:
    """One ``data:`` event (``data`` is one line of JSON)."""
    return b"data: " + (data.encode() if isinstance(data, str) else data) + b"\n\n"


def error_event(exc: BaseException) -> bytes:
    """The event that ends a stream that failed after it started (its status already sent)."""
    if isinstance(exc, RolloutEnginesError):
        kind, status = type(exc).__name__, next(
            (ERROR_STATUS[c.__name__] for c in type(exc).__mro__ if c.__name__ in ERROR_STATUS), 400)
    elif isinstance(exc, FieldError):
        kind, status = "ValidationError", 422
    elif isinstance(exc, ValueError):
        kind, status = "BadRequest", 400
    else:
        logger.error("stream failed", exc_info=exc)
        kind, status = "InternalError", 500
    body = error_body(kind, f"{exc}" if status != 500 else f"{type(exc).__name__}: {exc}",
                      getattr(exc, "param", None))
    body["error"]["code"] = status
    return event(json.dumps(body))


async def first_item(request: Request, source: AsyncGenerator[T, None]) -> T | None:
    """The first item of ``source`` (``None``: it is empty), awaited before the response starts, so
    that errors the engine raises up front (asleep, a missing capability, a bad request) are
    answered as typed JSON errors with their status. A client that disconnects meanwhile cancels it."""

    async def first() -> Any:
        try:
            return await source.__anext__()
        except StopAsyncIteration:
            return _END

    try:
        item = await cancel_on_disconnect(request, first())
    except BaseException:
        with contextlib.suppress(RuntimeError):  # still running: it was cancelled and ends by itself
            await source.aclose()
        raise
    return None if item is _END else item


class EventStreamResponse(Response):
    """``text/event-stream`` whose body is ``events`` (bytes, one or more events each). The next
    event is pulled only once the previous one is handed to the connection (uvicorn's ``send``
    waits while the client is not reading), so a slow client slows the engine instead of filling
    memory. When the client disconnects, the pull in progress is cancelled and ``events`` closed."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], status_code: int = 200,
                 headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = status_code
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        async def pump() -> None:
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await self.events.aclose()

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        task, watch = asyncio.ensure_future(pump()), asyncio.ensure_future(gone())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            watch.cancel()
            raise
        if task.done():
            watch.cancel()
            task.result()
            return
        task.cancel()  # the client is gone: stop pulling, close the source
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def events_of(items: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """``items`` then ``[DONE]``; an error after the start becomes an error event (then ``[DONE]``).
    Closing this closes ``items`` (which closes the engine's stream it reads)."""
    try:
        try:
            async for item in items:
                yield item
        except Exception as exc:  # the status line is sent: the error travels as an event
            yield error_event(exc)
        yield DONE
    finally:
        await items.aclose()
