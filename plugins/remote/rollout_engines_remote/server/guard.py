"""The Guard: a pure-ASGI layer in front of the app that checks every HTTP request (Host header,
API key, concurrency, body size and read time) and counts it in the metrics."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable, Collection, MutableMapping, Sequence
from typing import Any

from ..metrics import ServerMetrics
from .errors import BodyReadTimeout, error_response
from .limits import DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_CONCURRENCY

ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]
#: Host names every server answers to, whatever it is bound to.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_WILDCARD_BINDS = ("", "0.0.0.0", "::")
#: Paths counted under their own name in the metrics (the rest count as ``other``); an app passes
#: the paths it serves.
KNOWN_PATHS = frozenset({
    "/generate", "/generate/stream", "/abort", "/v1/completions", "/v1/chat/completions", "/v1/models", "/sleep",
    "/wake_up", "/reset_prefix_cache", "/pause", "/resume", "/weights/init", "/weights/update", "/weights/bucket",
    "/weights/abort", "/weights/close", "/weights/version", "/lora/unload", "/info", "/health", "/metrics",
})
#: Paths whose bodies stream through to the app (bounded by ``max_bucket_bytes``) instead of being read first.
STREAMED_BODY_PATHS = frozenset({"/weights/bucket"})


# ---- hosts: the Host header check against DNS rebinding ----------------------------------------
def host_name(value: str) -> str | None:
    """The host part of a ``Host`` header value, lower case, IP literals in canonical form
    (``[::1]:8000`` -> ``::1``); ``None`` when it is not a well-formed host[:port]."""
    text = value.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1 :] if end > 0 else "x"
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        name = text[1:end]
    elif text.count(":") > 1:  # a bare IPv6 literal
        name = text
    else:
        name, _, port = text.partition(":")
        if port and not port.isdigit():
            return None
        name = name.rstrip(".")
    if not name or any(c.isspace() or c in "/\\@?#" for c in name):
        return None
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def allowed_hosts_for(bind_host: str, extra: Sequence[str] | None = None) -> frozenset[str] | None:
    """The host names a server bound to ``bind_host`` answers to: loopback names, the bound address
    (bound to all addresses: this machine's host names; the address a request came in on is always
    accepted too), plus ``extra``. ``None`` (no check) when ``extra`` holds ``*``."""
    extra = [h.strip() for h in extra or () if h.strip()]
    if "*" in extra:
        return None
    hosts = set(LOOPBACK_HOSTS)
    bound = host_name(bind_host) if bind_host not in _WILDCARD_BINDS else None
    if bound:
        hosts.add(bound)
    else:
        for own in (socket.gethostname(), socket.getfqdn()):
            if host_name(own):
                hosts.add(str(host_name(own)))
    for h in extra:
        name = host_name(h)
        if name is None:
            raise ValueError(f"allowed host '{h}' is not a host name or IP address (no scheme, path or port)")
        hosts.add(name)
    return frozenset(hosts)


# ---- the guard: hosts, auth, concurrency, body size and read time, metrics ---------------------
class Guard:
    """Checks every HTTP request before the app sees it, in this order: the ``Host`` header (421),
    the API key (401, all but ``/health``), the number of requests in flight (503), the body's
    declared size (413); then it reads the body, bounded in size (413) and time (408), and hands it
    to the app. ``/weights/bucket`` bodies (up to ``max_bucket_bytes``) stream through instead, each
    read bounded by the body-read timeout."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, max_bucket_bytes: int,
                 metrics: ServerMetrics, allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS,
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
                 known_paths: Collection[str] = KNOWN_PATHS) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics
        self.known_paths = frozenset(known_paths)
        self.max_body_bytes, self.max_bucket_bytes = max_body_bytes, max_bucket_bytes
        self.allowed_hosts, self.max_concurrency = allowed_hosts, max_concurrency
        self.body_read_timeout_s = body_read_timeout_s
        self.active = 0
        self._expected = f"Bearer {api_key}".encode() if api_key else b""

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.known_paths else "other"
        status_box = [500]

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        start = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            await self._handle(scope, receive, send_wrapper, path)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(endpoint, str(status_box[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    def _host_refusal(self, scope: MutableMapping[str, Any]) -> str | None:
        if self.allowed_hosts is None:
            return None
        values = [v.decode("latin-1") for k, v in scope.get("headers") or [] if k == b"host"]
        if len(values) != 1:
            return "send exactly one Host header"
        name = host_name(values[0])
        if name is not None and name in self.allowed_hosts:
            return None
        server = scope.get("server")
        if name is not None and server and name == host_name(str(server[0])):
            return None  # the address this request arrived on (a literal: no DNS, no rebinding)
        shown = values[0][:100]
        port = f":{server[1]}" if server and len(server) > 1 else ""
        return (f"this server does not answer to Host '{shown}': use http://127.0.0.1{port} or another name it "
                f"is served under, or start it with --allowed-hosts NAME (create_app(allowed_hosts=[...]))")

    async def _handle(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                      send: Callable[[Any], Awaitable[None]], path: str) -> None:
        refusal = self._host_refusal(scope)
        if refusal is not None:
            await error_response(421, "MisdirectedRequest", refusal, param="host",
                                 headers={"connection": "close"})(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key and path != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                reason = "missing" if not given else "wrong"
                await error_response(401, "Unauthorized",
                                     f"{reason} API key: send 'Authorization: Bearer <key>' with the server's key "
                                     "(the file it was started with, or the one it wrote and logged at start)",
                                     headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        if path != "/health" and self.active >= self.max_concurrency:
            await error_response(503, "Overloaded", f"this server is handling its limit of {self.max_concurrency} "
                                 "requests at once; retry shortly, or start it with a higher --max-concurrency",
                                 headers={"Retry-After": "1"})(scope, receive, send)
            return
        self.active += 1
        try:
            await self._with_body(scope, receive, send, path, headers)
        finally:
            self.active -= 1

    async def _with_body(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                         send: Callable[[Any], Awaitable[None]], path: str, headers: dict[bytes, bytes]) -> None:
        streamed = path in STREAMED_BODY_PATHS
        limit = self.max_bucket_bytes if streamed else self.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await error_response(400, "BadRequest", "invalid Content-Length header; send the body's size in "
                                     "bytes")(scope, receive, send)
                return
            if declared > limit:
                await error_response(413, "PayloadTooLarge", f"request body of {declared} bytes exceeds this "
                                     f"endpoint's limit of {limit} bytes")(scope, receive, send)
                return
        if streamed:
            await self.app(scope, self._timed_receive(receive), send)
            return
        # Read the whole body (bounded in size and time), then replay it to the app.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_read_timeout_s
        chunks, total = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await error_response(408, "RequestTimeout", f"the request body did not arrive within "
                                     f"{self.body_read_timeout_s:g} s; send the whole body at once, or raise the "
                                     "server's --body-read-timeout", headers={"connection": "close"})(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                await error_response(413, "PayloadTooLarge",
                                     f"request body exceeds this endpoint's limit of {limit} bytes")(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, sent = b"".join(chunks), False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _timed_receive(self, receive: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        """``receive`` whose reads of the body time out (each, after ``body_read_timeout_s``); once the
        body is complete it waits as long as it takes (it then only reports a disconnect)."""
        done = False

        async def timed() -> Any:
            nonlocal done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_read_timeout_s)
            except asyncio.TimeoutError:
                raise BodyReadTimeout(self.body_read_timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                done = True
            return message

        return timed
