"""The HTTP client every adapter uses: pooled async connections, timeouts, retries with
exponential backoff for idempotent calls only, and server errors turned into typed exceptions."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from typing import Any

import httpx
from rollout_engines.errors import EngineUnavailable

from .protocol import error_from_payload, read_api_key_file

logger = logging.getLogger("rollout_engines.remote.http")

RETRY_STATUS = (502, 503, 504)
#: Seconds an idle pooled connection is reused. Below the server's keep-alive timeout (uvicorn's and
#: ``serve``'s default: 5 s; httpx's default expiry is the same 5 s), so the client never sends a
#: request on a connection the server is closing at that moment (the request would fail with a
#: ReadError, and a POST is not retried).
KEEPALIVE_EXPIRY_S = 2.0


class ApiClient:
    """One server's base URL plus its credentials.

    ``GET`` calls are retried (``retries`` times, backoff ``backoff_s * 2**attempt`` with jitter) on
    connection errors and 502/503/504; nothing else is ever retried, because a generate or a weight
    update that reached the server must not run twice. The one exception: with ``api_key_file``, a
    call refused with 401 (it never ran) is sent once more if the file now holds another key (a
    restarted server that wrote a new one).
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, api_key_file: str | os.PathLike[str] | None = None,
                 timeout_s: float = 600.0, connect_timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.2,
                 max_connections: int = 256) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key_file = api_key_file if not api_key else None
        if api_key is None and api_key_file is not None:
            api_key = read_api_key_file(api_key_file)
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.retries, self.backoff_s = retries, backoff_s
        self.limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                   keepalive_expiry=KEEPALIVE_EXPIRY_S)
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def client(self) -> httpx.AsyncClient:
        # An AsyncClient belongs to the event loop it first ran on; a caller that moves the engine
        # to another loop (a new asyncio.run, a BlockingEngine) gets a fresh pool there.
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop or self._loop.is_closed():
            self._client = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout,
                                             limits=self.limits)
            self._loop = loop
        return self._client

    def _reload_key(self) -> bool:
        """Re-read ``api_key_file``; True when it holds a key other than the one in use."""
        if self.api_key_file is None:
            return False
        try:
            key = read_api_key_file(self.api_key_file)
        except ValueError:
            return False
        headers = {"authorization": f"Bearer {key}"}
        if headers == self.headers:
            return False
        self.headers = headers
        if self._client is not None:
            self._client.headers.update(headers)
        return True

    def _delay(self, attempt: int) -> float:
        return self.backoff_s * (2**attempt) * (0.5 + random.random())

    async def request(self, method: str, path: str, *, json: Any = None, content: Any = None,
                      timeout: float | None = None, idempotent: bool | None = None, raw: bool = False,
                      pass_status: tuple[int, ...] = ()) -> Any:
        """The decoded answer (``raw``: the response). An error status raises its typed exception,
        except one in ``pass_status``, whose response is returned as it is for the caller to read
        (a server whose error answers carry a body of its own, such as SGLang's ``success: false``)."""
        idempotent = method == "GET" if idempotent is None else idempotent
        attempts = 1 + (self.retries if idempotent else 0)
        where = f"{method} {self.base_url}{path}"
        kwargs: dict[str, Any] = {}
        if content is not None and json is None:
            kwargs["headers"] = {"content-type": "application/json"}
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=self.timeout.connect)
        reloaded, attempt = False, 0
        while True:
            try:
                resp = await self.client().request(method, path, json=json, content=content, **kwargs)
            except httpx.TimeoutException as exc:
                if attempt + 1 < attempts:
                    await asyncio.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise EngineUnavailable(f"{where}: no answer in time ({type(exc).__name__}); the server is "
                                        "overloaded or stuck, or the timeout option is too short") from exc
            except httpx.TransportError as exc:
                if attempt + 1 < attempts:
                    await asyncio.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise EngineUnavailable(f"{where}: cannot reach the server ({exc!r}); is it running?") from exc
            if resp.status_code in RETRY_STATUS and attempt + 1 < attempts:
                await asyncio.sleep(self._delay(attempt))
                attempt += 1
                continue
            if (resp.status_code == 401 and not reloaded and isinstance(content, (bytes, str, type(None)))
                    and self._reload_key()):
                reloaded = True  # refused before it ran: safe to send again, once, with the new key
                continue
            if resp.status_code in pass_status:
                return resp
            return self._result(resp, where, raw)

    @staticmethod
    def decoded(resp: httpx.Response) -> Any:
        """The answer's body: its JSON, else its text."""
        try:
            return resp.json()
        except ValueError:
            return resp.text

    @staticmethod
    def _result(resp: httpx.Response, where: str, raw: bool) -> Any:
        if resp.status_code >= 400:
            raise error_from_payload(resp.status_code, ApiClient.decoded(resp), where)
        if raw:
            return resp
        if not resp.content:
            return None
        return ApiClient.decoded(resp)

    def get_sync(self, path: str, *, timeout: float | None = None) -> Any:
        """A blocking, retried GET (used while an engine is constructed, outside any event loop);
        the same rules as :meth:`request`: ``retries`` more attempts on connection errors and
        502/503/504, no sleep after the last one, and a 401 sent once more after a key reload
        (that resend is no retry)."""
        where = f"GET {self.base_url}{path}"
        t = httpx.Timeout(timeout or self.timeout.read or 30.0, connect=self.timeout.connect)
        attempts = 1 + self.retries
        reloaded, attempt = False, 0
        while True:
            try:
                with httpx.Client(base_url=self.base_url, headers=self.headers, timeout=t) as c:
                    resp = c.get(path)
            except httpx.TransportError as exc:  # (a timeout among them)
                if attempt + 1 < attempts:
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                if isinstance(exc, httpx.TimeoutException):
                    raise EngineUnavailable(f"{where}: no answer in time ({type(exc).__name__}); the server is "
                                            "overloaded or stuck, or the timeout option is too short") from exc
                raise EngineUnavailable(f"{where}: cannot reach the server ({exc!r}); is it running, and is the "
                                        "URL (EngineConfig.model or options['url']) right?") from exc
            if resp.status_code in RETRY_STATUS and attempt + 1 < attempts:
                time.sleep(self._delay(attempt))
                attempt += 1
                continue
            if resp.status_code == 401 and not reloaded and self._reload_key():
                reloaded = True  # refused before it ran: sent once more with the new key
                continue
            return self._result(resp, where, False)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.aclose()
            except RuntimeError:  # its loop is gone; the sockets went with it
                pass
