"""``rollout-engines serve``: any installed backend behind HTTP (FastAPI + uvicorn).

Endpoints (all but ``/health`` need ``Authorization: Bearer KEY``):

- OpenAI-compatible, non-streaming: ``POST /v1/completions``, ``POST /v1/chat/completions``,
  ``GET /v1/models``.
- Native token-in/token-out: ``POST /generate`` takes a core ``GenerateRequest`` and returns the
  list of core ``Completion`` objects.
- Control plane: ``POST /sleep``, ``/wake_up``, ``/reset_prefix_cache``, ``/pause``, ``/resume``;
  weight sync ``POST /weights/init`` (a ``TransportSpec``), ``/weights/update`` (a manifest; blocks
  until the update is applied), ``/weights/bucket`` (``http`` transport frames), ``/weights/abort``,
  ``/weights/close``, ``GET /weights/version``; ``GET /info``, ``/health``, ``/metrics``.

Client mistakes never give a 5xx: bad JSON or parameters are 422 naming the field, oversized
bodies 413, typed engine errors 400/409 (and 503 when the engine is closed), always as
``{"error": {"type", "message", "param"}}``.

Security (secure by default; see the project's SECURITY.md):

- The key is required unless auth is turned off explicitly (``--insecure-no-auth``, or
  ``create_app(insecure_no_auth=True)``; a warning is logged at every start). The CLI takes it from
  ``--api-key-file PATH``, ``$ROLLOUT_ENGINES_API_KEY`` or ``--api-key`` (visible to every local user
  in ``ps``); with none of them it generates one and writes it to a file only the user can read
  (``$XDG_RUNTIME_DIR/rollout-engines/serve-PORT.key``, else ``~/.cache/rollout-engines/serve-PORT.key``),
  logging the file's path, never the key.
- Every request's ``Host`` header must name this server (DNS rebinding): loopback names, the
  address it is bound to (or, bound to all addresses, the address the request came in on and this
  machine's host names), plus ``--allowed-hosts``; others get 421. ``--allowed-hosts '*'`` turns
  the check off.
- ``disk`` weight transfers must use a folder under ``--weights-root``; without one they are refused.
- At most ``--max-concurrency`` requests are handled at once (beyond: 503, ``Retry-After: 1``); a
  request body must arrive within ``--body-read-timeout`` seconds (buckets: with no pause longer
  than that), else 408. A generate whose client disconnects is cancelled. One ``/weights/init`` runs
  at a time; a second one, while the first is in progress, gets 409 (retry after the first answers:
  it ends within its spec's ``timeout_s``).
- uvicorn has no timeout for reading request headers: a server reachable by untrusted clients
  must sit behind a reverse proxy that bounds header reads (and terminates TLS).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import hmac
import ipaddress
import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError
from rollout_engines.engine import Engine
from rollout_engines.errors import RolloutEnginesError
from rollout_engines.types import Completion, EngineInfo, GenerateRequest
from rollout_engines.weights.manifest import TransportSpec, WeightManifest
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import openai_api as oai
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    API_KEY_ENV,
    ERROR_STATUS,
    AbortBody,
    ErrorBody,
    HealthBody,
    OkBody,
    SleepBody,
    VersionBody,
    WakeUpBody,
)
from .transport import MAX_FRAME_HEADER, HttpIngress, parse_frame_header, relay_transport

logger = logging.getLogger("rollout_engines.remote.server")

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_BUCKET_BYTES = 8 * 2**30
DEFAULT_MAX_SEQUENCES = 4096
DEFAULT_MAX_CONCURRENCY = 512
DEFAULT_BODY_READ_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5
#: Largest ``top_k`` any backend can take (a 32-bit count), where the vocabulary size is unknown.
MAX_TOP_K = 2**31 - 1
#: Host names every server answers to, whatever it is bound to.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_WILDCARD_BINDS = ("", "0.0.0.0", "::")

_COMPLETIONS = TypeAdapter(list[Completion])
ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]
KNOWN_PATHS = {
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/sleep", "/wake_up",
    "/reset_prefix_cache", "/pause", "/resume", "/weights/init", "/weights/update", "/weights/bucket",
    "/weights/abort", "/weights/close", "/weights/version", "/info", "/health", "/metrics",
}


class FieldError(ValueError):
    """A request value the server cannot serve (beyond the core model's own validation)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def error_response(status: int, kind: str, message: str, param: str | None = None,
                   fields: list[dict[str, Any]] | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"type": kind, "message": message, "param": param}
    if fields is not None:
        body["fields"] = fields
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _dotted(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts)


def _validation_response(errors: Sequence[Any]) -> JSONResponse:
    fields = []
    for e in errors:
        fields.append({"param": _dotted(e.get("loc", ())), "message": str(e.get("msg", "")), "type": e.get("type")})
    first = fields[0] if fields else {"param": None, "message": "invalid request"}
    text = "; ".join(f"{f['param'] or '(body)'}: {f['message']}" for f in fields[:8])
    return error_response(422, "ValidationError", f"invalid request: {text}", param=first["param"] or None,
                          fields=fields)


# ---- limits the server enforces beyond the core's models ---------------------------------------
class Limits:
    """What the server checks beyond the core's models, so that no request value can make the
    engine fail with a 5xx: sequences per request, the seed's range, finite floats, token ids and
    ``top_k`` within the vocabulary. Prompt lengths are the engine's to check (it raises
    ``InvalidRequest``)."""

    def __init__(self, engine: Engine, max_sequences: int = DEFAULT_MAX_SEQUENCES) -> None:
        self.vocab_size: int | None = None
        self.max_sequences = max_sequences
        self.tokenizer: Any = None
        cfg_file = Path(engine.config.model) / "config.json"
        if cfg_file.is_file():
            try:
                self.vocab_size = json.loads(cfg_file.read_text()).get("vocab_size")
            except (OSError, ValueError):
                logger.warning("could not read %s; token ids are not range-checked", cfg_file)
        path = Path(engine.config.tokenizer or engine.config.model)
        if path.is_dir():
            try:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(str(path))
            except Exception:  # a backend with its own tokenizer format: logprob tokens show as ids
                logger.info("no transformers tokenizer at %s; logprob tokens are shown as ids", path)

    def decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))

    def check(self, req: GenerateRequest) -> None:
        s = req.sampling
        if not math.isfinite(s.temperature):
            raise FieldError("sampling.temperature", "must be a finite number")
        if s.seed is not None and not -(2**63) <= s.seed < 2**63:
            raise FieldError("sampling.seed", "must fit in 64 bits: [-2**63, 2**63)")
        for i, conversation in enumerate(req.messages or []):
            if not conversation:
                raise FieldError(f"messages.{i}", "a conversation needs at least one message")
        top_k_limit = self.vocab_size or MAX_TOP_K
        if s.top_k > top_k_limit:
            what = f"the vocabulary size ({self.vocab_size})" if self.vocab_size else f"{MAX_TOP_K}"
            raise FieldError("sampling.top_k", f"top_k {s.top_k} is larger than {what}; use -1 to disable top-k")
        if req.batch_size * s.n > self.max_sequences:
            raise FieldError("sampling.n", f"batch size x n = {req.batch_size * s.n} exceeds this server's "
                             f"limit of {self.max_sequences} sequences per request; split the batch")
        if self.vocab_size:
            ids = [t for p in req.prompt_token_ids or [] for t in p]
            for name, values in (("prompt_token_ids", ids), ("sampling.stop_token_ids", s.stop_token_ids)):
                bad = [t for t in values if not 0 <= t < self.vocab_size]
                if bad:
                    raise FieldError(name, f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")


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
        for name in (socket.gethostname(), socket.getfqdn()):
            if host_name(name):
                hosts.add(str(host_name(name)))
    for h in extra:
        name = host_name(h)
        if name is None:
            raise ValueError(f"allowed host '{h}' is not a host name or IP address (no scheme, path or port)")
        hosts.add(name)
    return frozenset(hosts)


# ---- the guard: hosts, auth, concurrency, body size and read time, metrics (pure ASGI) -----------
class BodyReadTimeout(StarletteHTTPException):
    """The client stopped sending the request body."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive in time (no data for {timeout_s:g} s); "
                              "send the whole body without pausing, or raise the server's --body-read-timeout")


class Guard:
    """Checks every HTTP request before the app sees it, in this order: the ``Host`` header (421),
    the API key (401, all but ``/health``), the number of requests in flight (503), the body's
    declared size (413); then it reads the body, bounded in size (413) and time (408), and hands it
    to the app. ``/weights/bucket`` bodies (up to ``max_bucket_bytes``) stream through instead, each
    read bounded by the body-read timeout."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, max_bucket_bytes: int,
                 metrics: ServerMetrics, allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS,
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics
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
        endpoint = path if path in KNOWN_PATHS else "other"
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
        limit = self.max_bucket_bytes if path == "/weights/bucket" else self.max_body_bytes
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
        if path == "/weights/bucket":
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


# ---- the app -----------------------------------------------------------------------------------
class ServerState:
    def __init__(self, engine: Engine, model_name: str, max_sequences: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.ingress = HttpIngress(engine)
        self.metrics = ServerMetrics()
        self.limits: Limits | None = None
        self.max_sequences = max_sequences
        self.started = time.time()
        self.init_started: float | None = None  # monotonic start of the /weights/init in progress

    def get_limits(self) -> Limits:
        if self.limits is None:
            self.limits = Limits(self.engine, self.max_sequences)
        return self.limits


class Forbidden(Exception):
    """A request the server's configuration does not allow (403)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Conflict(Exception):
    """A request that cannot run now because of one in progress (409)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its work was cancelled."""


def confine_disk_spec(spec: TransportSpec, weights_root: str | None) -> TransportSpec:
    """``spec`` with its ``disk`` folder checked to lie inside ``weights_root`` (after resolving every
    link) and replaced by its resolved path. Raises :class:`Forbidden` or :class:`FieldError`."""
    if weights_root is None:
        raise Forbidden("disk weight transfers over HTTP are off on this server: start it with --weights-root DIR "
                        "(create_app(weights_root=DIR)) and have the trainer write its updates under DIR",
                        param="options.path")
    raw = spec.options.get("path")
    if not isinstance(raw, str) or not raw:
        raise FieldError("options.path", f"a disk transfer needs options['path'], a folder under this server's "
                         f"weights root {weights_root}")
    try:
        real = os.path.realpath(os.path.join(weights_root, raw))
    except (ValueError, OSError):
        raise FieldError("options.path", "not a usable file-system path") from None
    if os.path.commonpath([real, weights_root]) != weights_root:
        raise Forbidden(f"options.path '{raw[:300]}' is not inside this server's weights root {weights_root} "
                        "(links are followed); write the updates under that folder, or restart the server with "
                        "another --weights-root", param="options.path")
    if not os.path.isdir(real):
        raise FieldError("options.path", f"'{raw[:300]}' is not an existing folder on the server; the trainer "
                         "creates it when it opens the transfer (connect_weight_sync)")
    return spec.model_copy(update={"options": {**spec.options, "path": real}})


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task}, timeout=10.0)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved, so that asyncio does not log it
    raise ClientDisconnected("the client disconnected; its generation was cancelled")


def create_app(
    engine: Engine,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    insecure_no_auth: bool = False,
    allowed_hosts: Sequence[str] | None = None,
    bind_host: str = "127.0.0.1",
    weights_root: str | os.PathLike[str] | None = None,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
    max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    model_name: str | None = None,
    close_engine: bool = True,
    close_timeout_s: float = 30.0,
    exit_process_on_close_timeout: bool = False,
) -> Any:
    """The ASGI app serving ``engine``.

    Every endpoint but ``/health`` needs ``Authorization: Bearer <api_key>``; serving without a key
    needs ``insecure_no_auth=True`` (anyone who reaches the port can then push weights). Requests
    must carry a ``Host`` the server answers to: loopback names, ``bind_host`` (the address the
    server listens on) and ``allowed_hosts`` (``["*"]``: no check). ``disk`` weight transfers must
    use a folder inside ``weights_root`` (none: refused). ``max_concurrency`` requests at once
    (beyond: 503); request bodies must arrive within ``body_read_timeout_s`` (408).
    ``close_engine``: close the engine when the app shuts down, waiting at most ``close_timeout_s``
    for work it is still doing (then the process exits anyway)."""
    if not api_key and not insecure_no_auth:
        raise ValueError("create_app() needs api_key='...' (clients send 'Authorization: Bearer KEY'); to serve "
                         "without authentication, which lets anyone who reaches the port push weights, pass "
                         "insecure_no_auth=True")
    if api_key and insecure_no_auth:
        raise ValueError("pass either api_key= or insecure_no_auth=True, not both")
    if insecure_no_auth:
        logger.warning("serving WITHOUT authentication (insecure_no_auth): anyone who can reach this server can "
                       "generate, sleep it and push weights into it")
    hosts = allowed_hosts_for(bind_host, allowed_hosts)
    root = None
    if weights_root is not None:
        root = os.path.realpath(os.fspath(weights_root))
        if not os.path.isdir(root):
            raise ValueError(f"weights_root {weights_root} is not an existing folder")
    state = ServerState(engine, model_name or engine.config.model, max_sequences)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(state.get_limits)
        state.metrics.weight_version.set(engine.weight_version)
        yield
        with contextlib.suppress(Exception):
            await state.ingress.close()
        if close_engine:
            try:
                await asyncio.wait_for(engine.close(), close_timeout_s)
            except asyncio.TimeoutError:
                logger.warning("the engine did not close within %.0f s; exiting without waiting for it",
                               close_timeout_s)
                if exit_process_on_close_timeout:
                    # The engine's threads would keep the interpreter alive until their work ends;
                    # every request is answered or aborted by now, so end the process here, and
                    # the engine's worker processes with it (they must not outlive the server).
                    _stop_children()
                    logging.shutdown()
                    os._exit(0)

    app = FastAPI(title="rollout-engines server", version="0.1.0", lifespan=lifespan,
                  responses={422: {"model": ErrorBody}, 409: {"model": ErrorBody}, 400: {"model": ErrorBody}})
    app.state.roe = state

    # ---- errors ---------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc.errors())

    @app.exception_handler(ValidationError)
    async def _on_pydantic(request: Request, exc: ValidationError) -> JSONResponse:
        return _validation_response(exc.errors())

    @app.exception_handler(FieldError)
    async def _on_field(request: Request, exc: FieldError) -> JSONResponse:
        return error_response(422, "ValidationError", str(exc), param=exc.param)

    @app.exception_handler(Forbidden)
    async def _on_forbidden(request: Request, exc: Forbidden) -> JSONResponse:
        return error_response(403, "Forbidden", str(exc), param=exc.param)

    @app.exception_handler(Conflict)
    async def _on_conflict(request: Request, exc: Conflict) -> JSONResponse:
        return error_response(409, exc.kind, str(exc))

    @app.exception_handler(ClientDisconnected)
    async def _on_gone(request: Request, exc: ClientDisconnected) -> JSONResponse:
        # Nobody reads this answer; the status shows in the metrics (nginx's "client closed request").
        return error_response(499, "ClientClosedRequest", str(exc))

    @app.exception_handler(BodyReadTimeout)
    async def _on_body_timeout(request: Request, exc: BodyReadTimeout) -> JSONResponse:
        return error_response(408, "RequestTimeout", str(exc.detail), headers={"connection": "close"})

    @app.exception_handler(RolloutEnginesError)
    async def _on_engine_error(request: Request, exc: RolloutEnginesError) -> JSONResponse:
        status = next((ERROR_STATUS[c.__name__] for c in type(exc).__mro__ if c.__name__ in ERROR_STATUS), 400)
        return error_response(status, type(exc).__name__, str(exc))

    @app.exception_handler(ValueError)
    async def _on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, "BadRequest", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, "HTTPError", str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _on_crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, "InternalError", f"{type(exc).__name__}: {exc}")

    # ---- generation -----------------------------------------------------------------------------
    async def run(req: GenerateRequest, request: Request) -> list[Completion]:
        state.get_limits().check(req)
        outs = await cancel_on_disconnect(request, engine.generate(req))
        m = state.metrics
        m.prompt_tokens.inc(sum(len(c.prompt_token_ids) for c in outs if c.sample_index == 0))
        m.generated_tokens.inc(sum(len(c.token_ids) for c in outs))
        for c in outs:
            m.completions.labels(c.finish_reason).inc()
        return outs

    @app.post("/generate", response_model=list[Completion], tags=["native"])
    async def generate(body: GenerateRequest, request: Request) -> Response:
        """Token-in/token-out (or text/chat-in) generation with the core's request and output types."""
        outs = await run(body, request)
        return Response(_COMPLETIONS.dump_json(outs), media_type="application/json")

    @app.post("/v1/completions", response_model=oai.CompletionResponse, tags=["openai"])
    async def completions(body: oai.CompletionRequest, request: Request) -> oai.CompletionResponse:
        outs = await run(body.to_core(), request)
        limits = state.get_limits()
        return oai.completion_response(outs, state.model_name, body.n, body.logprobs is not None, limits.decode_token)

    @app.post("/v1/chat/completions", response_model=oai.ChatCompletionResponse, tags=["openai"])
    async def chat_completions(body: oai.ChatCompletionRequest, request: Request) -> oai.ChatCompletionResponse:
        outs = await run(body.to_core(), request)
        limits = state.get_limits()
        return oai.chat_response(outs, state.model_name, body.n, body.logprobs, limits.decode_token)

    @app.get("/v1/models", response_model=oai.ModelList, tags=["openai"])
    async def models() -> oai.ModelList:
        return oai.ModelList(data=[oai.ModelCard(id=state.model_name, created=int(state.started))])

    # ---- control plane --------------------------------------------------------------------------
    def ok() -> OkBody:
        return OkBody(weight_version=engine.weight_version)

    @app.post("/sleep", response_model=OkBody, tags=["control"])
    async def sleep(body: SleepBody | None = None) -> OkBody:
        body = body or SleepBody()
        await engine.sleep(body.level, body.tags)
        return ok()

    @app.post("/wake_up", response_model=OkBody, tags=["control"])
    async def wake_up(body: WakeUpBody | None = None) -> OkBody:
        await engine.wake_up((body or WakeUpBody()).tags)
        return ok()

    @app.post("/reset_prefix_cache", response_model=OkBody, tags=["control"])
    async def reset_prefix_cache() -> OkBody:
        await engine.reset_prefix_cache()
        return ok()

    @app.post("/pause", response_model=OkBody, tags=["control"])
    async def pause() -> OkBody:
        await engine.pause()
        return ok()

    @app.post("/resume", response_model=OkBody, tags=["control"])
    async def resume() -> OkBody:
        await engine.resume()
        return ok()

    # ---- weights --------------------------------------------------------------------------------
    @app.post("/weights/init", response_model=OkBody, tags=["weights"])
    async def weights_init(body: TransportSpec) -> OkBody:
        """Join a trainer's weight-sync session. ``http``: the server relays POSTed buckets; any
        other transport (gloo, nccl, shm, disk): the engine's workers join it directly. One init at
        a time: a second one while the first is in progress gets 409 ``InitInProgress``. ``disk``:
        ``options.path`` must lie inside the server's weights root."""
        if state.init_started is not None:
            raise Conflict("InitInProgress", f"a weight-sync init is in progress (for "
                           f"{time.monotonic() - state.init_started:.0f} s); retry once it has answered: it "
                           "ends within its spec's timeout_s")
        if body.transport == "disk":
            body = confine_disk_spec(body, root)
        state.init_started = time.monotonic()
        try:
            if body.transport == "http":
                await state.ingress.open(body)
            else:
                await engine.init_weight_transfer(body)
        finally:
            state.init_started = None
        return ok()

    @app.post("/weights/update", response_model=VersionBody, tags=["weights"])
    async def weights_update(body: WeightManifest) -> VersionBody:
        """Receive one update described by the manifest; answers once it is applied (or rejected)."""
        if body.transport == "disk" and any(c in body.session_id[:16] for c in "/\\\0"):
            raise FieldError("session_id", "a disk update's session_id names a folder: use letters, digits, "
                             "'-' and '_' only")
        try:
            if body.transport == "http":
                version = await state.ingress.update(body)
            else:
                version = await engine.receive_weights(body)
        except BaseException:
            state.metrics.weight_updates.labels("failed").inc()
            raise
        state.metrics.weight_updates.labels("ok").inc()
        state.metrics.weight_version.set(version)
        return VersionBody(weight_version=version)

    @app.post("/weights/bucket", response_model=OkBody, tags=["weights"],
              openapi_extra={"requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}, "required": True}})
    async def weights_bucket(request: Request) -> OkBody:
        """One ``http`` transport frame: a safetensors file with one U8 tensor, the bucket."""
        length = request.headers.get("content-length")
        if length is None:
            raise FieldError("content-length", "bucket frames need a Content-Length header")
        stream = request.stream()
        pending = bytearray()
        async for chunk in stream:
            pending += chunk
            if len(pending) >= 8:
                break
        if len(pending) < 8:
            raise FieldError("body", "bucket frame shorter than its 8-byte header length")
        hlen = int.from_bytes(pending[:8], "little")
        if hlen > MAX_FRAME_HEADER:
            raise FieldError("body", f"bucket frame header of {hlen} bytes is larger than {MAX_FRAME_HEADER}")
        while len(pending) < 8 + hlen:
            chunk = await anext(stream, None)
            if chunk is None:
                raise FieldError("body", "bucket frame ended inside its header")
            pending += chunk
        try:
            meta, nbytes = parse_frame_header(bytes(pending[8 : 8 + hlen]))
            for key in ("session", "update", "index"):
                if key not in meta:
                    raise ValueError(f"bucket frame metadata lacks '{key}'")
        except ValueError as exc:
            raise FieldError("body", str(exc)) from None
        if int(length) != 8 + hlen + nbytes:
            raise FieldError("content-length", f"{length} != frame size {8 + hlen + nbytes}")
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy()).cast("B")
        first = bytes(pending[8 + hlen :])
        pos = len(first)
        if pos > nbytes:
            raise FieldError("body", "bucket frame is longer than its tensor")
        view[:pos] = first
        async for chunk in stream:
            end = pos + len(chunk)
            if end > nbytes:
                raise FieldError("body", "bucket frame is longer than its tensor")
            view[pos:end] = chunk
            pos = end
        if pos != nbytes:
            raise FieldError("body", f"bucket frame truncated: {pos} of {nbytes} bytes")
        state.metrics.weight_bytes.inc(nbytes)
        await state.ingress.feed(meta, buf)
        return ok()

    @app.post("/weights/abort", response_model=OkBody, tags=["weights"])
    async def weights_abort(body: AbortBody) -> OkBody:
        await state.ingress.abort(body.session, body.update, body.reason)
        return ok()

    @app.post("/weights/close", response_model=OkBody, tags=["weights"])
    async def weights_close() -> OkBody:
        await state.ingress.close()
        await engine.close_weight_transfer()
        return ok()

    @app.get("/weights/version", response_model=VersionBody, tags=["weights"])
    async def weights_version() -> VersionBody:
        return VersionBody(weight_version=engine.weight_version)

    # ---- status ---------------------------------------------------------------------------------
    @app.get("/info", response_model=EngineInfo, tags=["status"])
    async def info() -> EngineInfo:
        """The served engine's info; ``extra.server`` adds what a remote client needs."""
        base = await engine.info()
        caps = dict(base.capabilities)
        transports = list(caps.get("transports", []))
        if relay_transport(engine) is not None and "http" not in transports:
            transports.append("http")
        caps["transports"] = transports
        server = {"weight_receivers": engine.weight_receivers(), "model_name": state.model_name,
                  "auth": bool(api_key), "relay": relay_transport(engine), "weights_root": root}
        return base.model_copy(update={"capabilities": caps, "extra": {**base.extra, "server": server}})

    @app.get("/health", response_model=HealthBody, tags=["status"], responses={503: {"model": HealthBody}})
    async def health() -> Response:
        healthy = await engine.health()
        body = HealthBody(status="ok" if healthy else "unavailable", weight_version=engine.weight_version)
        return JSONResponse(body.model_dump(), status_code=200 if healthy else 503)

    @app.get("/metrics", tags=["status"], response_class=Response)
    async def metrics() -> Response:
        state.metrics.weight_version.set(engine.weight_version)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return Guard(app, api_key=api_key or None, max_body_bytes=max_body_bytes, max_bucket_bytes=max_bucket_bytes,
                 metrics=state.metrics, allowed_hosts=hosts, max_concurrency=max_concurrency,
                 body_read_timeout_s=body_read_timeout_s)


def _stop_children(grace_s: float = 5.0) -> None:
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(grace_s)
        if child.is_alive():
            child.kill()


def fastapi_app(app: Any) -> FastAPI:
    """The FastAPI app inside what :func:`create_app` returns (for its OpenAPI schema)."""
    return app.app if isinstance(app, Guard) else app


# ---- the API key on the command line: from a file, the environment, or made and written ---------
class KeyFileError(RuntimeError):
    """An API key file that cannot be used safely."""


def default_key_file(port: int) -> Path:
    """Where ``serve`` writes the key it generates: ``$XDG_RUNTIME_DIR/rollout-engines/serve-PORT.key``
    (a per-user folder), else ``~/.cache/rollout-engines/serve-PORT.key``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and os.path.isdir(runtime) else Path.home() / ".cache"
    return base / "rollout-engines" / f"serve-{port}.key"


def write_key_file(path: Path, key: str) -> None:
    """Write ``key`` to ``path``, readable and writable by this user only (mode 0600). The file is
    created under a fresh random name with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (so nobody can have
    opened or linked it before) and then renamed over ``path``."""
    parent = path.parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(parent)
    sticky = bool(st.st_mode & 0o1000)
    if st.st_uid not in (os.getuid(), 0) or (st.st_mode & 0o022 and not sticky):
        raise KeyFileError(f"{parent} is writable by other users; pass --api-key-file with a path in a folder only "
                           "you can write")
    tmp = parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.write(fd, key.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_key_file(path: Path) -> str:
    """The key in ``path`` (surrounding white space removed). The file must belong to this user (or
    root); one that other users can read is used with a warning."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise KeyFileError(f"cannot read the API key file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid not in (os.getuid(), 0):
            raise KeyFileError(f"the API key file {path} belongs to another user; use a file you own (mode 0600)")
        if st.st_mode & 0o077:
            logger.warning("the API key file %s can be read by other users; chmod 600 it", path)
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    key = data.decode("utf-8", "replace").strip()
    if not key or len(data) > 4096 or any(c.isspace() for c in key):
        raise KeyFileError(f"the API key file {path} must hold one key (1 to 4096 characters, no spaces)")
    return key


def resolve_api_key(ns: argparse.Namespace) -> tuple[str | None, Path | None]:
    """The server's key from the command line and environment, and the path of the file this call
    wrote (to remove at exit; ``None`` when it wrote none). Order: ``--api-key``,
    ``--api-key-file`` (read; made with a new key when it does not exist), ``$ROLLOUT_ENGINES_API_KEY``,
    else a new key written to :func:`default_key_file`."""
    env_key = os.environ.get(API_KEY_ENV) or None
    if ns.insecure_no_auth:
        if ns.api_key or ns.api_key_file:
            raise KeyFileError("--insecure-no-auth turns the API key off: do not also pass --api-key/--api-key-file")
        if env_key:
            logger.warning("%s is set but ignored: --insecure-no-auth turns authentication off", API_KEY_ENV)
        return None, None
    if ns.api_key:
        logger.warning("--api-key is visible to every user of this machine (ps, /proc); prefer --api-key-file or "
                       "$%s", API_KEY_ENV)
        return ns.api_key, None
    if ns.api_key_file:
        path = Path(ns.api_key_file).expanduser()
        if os.path.lexists(path):
            return read_key_file(path), None
        key = secrets.token_urlsafe(32)
        write_key_file(path, key)
        _announce_key_file(path)
        return key, None
    if env_key:
        return env_key, None
    path = default_key_file(ns.port)
    key = secrets.token_urlsafe(32)
    write_key_file(path, key)
    _announce_key_file(path)
    return key, path


def _announce_key_file(path: Path) -> None:
    message = (f"API key written to {path} (mode 0600). Clients: create_engine('remote', ..., "
               f"api_key_file='{path}') or {API_KEY_ENV}=$(cat {path})")
    logger.warning("%s", message)


class AcceptErrorFilter(logging.Filter):
    """Lets one accept error ("Too many open files" and the like) through per ``every_s`` seconds;
    the rest are counted and the count is added to the next one that passes. Other records pass."""

    ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

    def __init__(self, every_s: float = 10.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last = -math.inf
        self._dropped = 0
        self._lock = threading.Lock()

    def _is_accept_error(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OSError) and exc.errno in self.ERRNOS:
            return True
        text = record.getMessage().lower()
        return "too many open files" in text or "socket.accept()" in text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._is_accept_error(record):
            return True
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._dropped += 1
                return False
            self._last, dropped, self._dropped = now, self._dropped, 0
        if dropped:
            record.msg = f"{record.getMessage()} ({dropped} more like it in the last {self.every_s:g} s not logged)"
            record.args = ()
        return True


def install_accept_error_filter(every_s: float = 10.0) -> AcceptErrorFilter:
    """Rate-limit accept-error logging (asyncio's and uvicorn's) so a file-descriptor flood cannot
    flood the log too."""
    flt = AcceptErrorFilter(every_s)
    for name in ("uvicorn.error", "asyncio"):
        logging.getLogger(name).addFilter(flt)
    return flt


# ---- command line ------------------------------------------------------------------------------
def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option wants KEY=VALUE, got '{text}'")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-engines serve", description="Serve an engine of any installed backend over HTTP.")
    p.add_argument("--backend", default="transformers", help="backend name (see `rollout-engines backends`)")
    p.add_argument("--model", required=True, help="model path")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from PATH (made, mode 0600, with a new key if it does not exist)")
    p.add_argument("--api-key", default=None,
                   help=f"the API key itself; visible to every local user in ps: prefer --api-key-file or ${API_KEY_ENV}. "
                        "With no key given, one is generated and written to "
                        "$XDG_RUNTIME_DIR/rollout-engines/serve-PORT.key (else ~/.cache/rollout-engines/...)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve without an API key: anyone who can reach the port can push weights")
    p.add_argument("--allowed-hosts", default="", metavar="A,B",
                   help="more Host header names to answer to, besides loopback names and --host; '*': any")
    p.add_argument("--weights-root", default=None, metavar="DIR",
                   help="allow disk weight transfers from folders under DIR (without it they are refused)")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help="requests handled at once; beyond, 503 with Retry-After")
    p.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT_S, metavar="SECONDS",
                   help="a request body must arrive within this time (408 otherwise)")
    p.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S, metavar="SECONDS",
                   help="close idle keep-alive connections after this many seconds")
    p.add_argument("--option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="engine option (EngineConfig field or backend option); VALUE parsed as JSON when it can be")
    p.add_argument("--factory", default=None, metavar="MODULE:CLASS",
                   help="serve an engine class that is not a registered backend (tests, benchmarks)")
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models (default: --model)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--max-bucket-bytes", type=int, default=DEFAULT_MAX_BUCKET_BYTES)
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown before they are aborted")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``rollout-engines serve ...``: start the engine, then serve it until SIGINT/SIGTERM."""
    import uvicorn
    from rollout_engines.factory import create_engine

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        args = args[1:]
    parser = build_parser()
    ns = parser.parse_args(args)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_accept_error_filter()
    if ns.max_concurrency < 1 or ns.body_read_timeout <= 0 or ns.timeout_keep_alive < 1:
        parser.error("--max-concurrency, --body-read-timeout and --timeout-keep-alive must be positive")
    allowed = [h for h in ns.allowed_hosts.split(",") if h.strip()]
    try:
        allowed_hosts_for(ns.host, allowed)
    except ValueError as exc:
        parser.error(f"--allowed-hosts: {exc}")
    if ns.weights_root is not None and not os.path.isdir(ns.weights_root):
        parser.error(f"--weights-root {ns.weights_root} is not an existing folder")
    try:
        api_key, written = resolve_api_key(ns)
    except (KeyFileError, OSError) as exc:
        parser.error(str(exc))
    options = dict(ns.option)
    logger.info("starting a '%s' engine on %s", ns.backend, ns.model)
    try:
        if ns.factory:
            from rollout_engines.plugins import _import_target
            from rollout_engines.types import EngineConfig

            fields = set(EngineConfig.model_fields)
            config = EngineConfig(backend=ns.backend, model=ns.model,
                                  **{k: v for k, v in options.items() if k in fields},
                                  options={k: v for k, v in options.items() if k not in fields})
            engine = _import_target(ns.factory)(config)
        else:
            engine = create_engine(ns.backend, model=ns.model, **options)
        app = create_app(engine, api_key=api_key, insecure_no_auth=ns.insecure_no_auth, allowed_hosts=allowed,
                         bind_host=ns.host, weights_root=ns.weights_root, max_concurrency=ns.max_concurrency,
                         body_read_timeout_s=ns.body_read_timeout, max_body_bytes=ns.max_body_bytes,
                         max_bucket_bytes=ns.max_bucket_bytes, model_name=ns.served_model_name,
                         close_timeout_s=ns.grace_period, exit_process_on_close_timeout=True)
        # The Guard answers typed 503s beyond --max-concurrency requests; uvicorn's own (plain) 503
        # bounds open connections, idle keep-alive ones included, at twice that.
        config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(), lifespan="on",
                                timeout_graceful_shutdown=ns.grace_period, access_log=False, backlog=4096,
                                limit_concurrency=max(2 * ns.max_concurrency, ns.max_concurrency + 64),
                                timeout_keep_alive=ns.timeout_keep_alive)
        server = _graceful_server_class()(config)
        server.run()
    finally:
        if written is not None:
            _remove_key_file(written, api_key)
    logger.info("server stopped")
    return 0


def _remove_key_file(path: Path, key: str | None) -> None:
    """Remove the key file this server wrote, unless another server has written its own there since."""
    with contextlib.suppress(OSError, KeyFileError):
        if read_key_file(path) == key:
            path.unlink()


def _graceful_server_class() -> type:
    import signal
    import threading

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown, so the process dies of the signal;
        a server that drained cleanly should exit 0 instead."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer


if __name__ == "__main__":
    sys.exit(main())
