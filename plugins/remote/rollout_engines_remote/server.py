"""``rollout-engines serve``: any installed backend behind HTTP (FastAPI + uvicorn).

Endpoints (all but ``/health`` need ``Authorization: Bearer KEY`` when the server has a key):

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import sys
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
    engine fail with a 5xx: sequences per request, the seed's range, finite floats, token ids in
    the vocabulary. Prompt lengths are the engine's to check (it raises ``InvalidRequest``)."""

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
        if req.batch_size * s.n > self.max_sequences:
            raise FieldError("sampling.n", f"batch size x n = {req.batch_size * s.n} exceeds this server's "
                             f"limit of {self.max_sequences} sequences per request; split the batch")
        if self.vocab_size:
            ids = [t for p in req.prompt_token_ids or [] for t in p]
            for name, values in (("prompt_token_ids", ids), ("sampling.stop_token_ids", s.stop_token_ids)):
                bad = [t for t in values if not 0 <= t < self.vocab_size]
                if bad:
                    raise FieldError(name, f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")


# ---- the guard: auth, body size, metrics (pure ASGI, so streaming bodies stay streaming) --------
class Guard:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, max_bucket_bytes: int,
                 metrics: ServerMetrics) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics
        self.max_body_bytes, self.max_bucket_bytes = max_body_bytes, max_bucket_bytes
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

    async def _handle(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                      send: Callable[[Any], Awaitable[None]], path: str) -> None:
        headers = dict(scope.get("headers") or [])
        if self.api_key and path != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                reason = "missing" if not given else "wrong"
                await error_response(401, "Unauthorized",
                                     f"{reason} API key: send 'Authorization: Bearer <key>' with the server's key",
                                     headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        limit = self.max_bucket_bytes if path == "/weights/bucket" else self.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await error_response(400, "BadRequest", "invalid Content-Length header")(scope, receive, send)
                return
            if declared > limit:
                await error_response(413, "PayloadTooLarge", f"request body of {declared} bytes exceeds this "
                                     f"endpoint's limit of {limit} bytes")(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if path == "/weights/bucket" or scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read up to the limit, then replay it to the app.
        chunks, total = [], 0
        while True:
            message = await receive()
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

    def get_limits(self) -> Limits:
        if self.limits is None:
            self.limits = Limits(self.engine, self.max_sequences)
        return self.limits


def create_app(
    engine: Engine,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    model_name: str | None = None,
    close_engine: bool = True,
    close_timeout_s: float = 30.0,
    exit_process_on_close_timeout: bool = False,
) -> Any:
    """The ASGI app serving ``engine``. With ``api_key`` every endpoint but ``/health`` needs
    ``Authorization: Bearer <api_key>``. ``close_engine``: close the engine when the app shuts down,
    waiting at most ``close_timeout_s`` for work it is still doing (then the process exits anyway)."""
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
    async def run(req: GenerateRequest) -> list[Completion]:
        state.get_limits().check(req)
        outs = await engine.generate(req)
        m = state.metrics
        m.prompt_tokens.inc(sum(len(c.prompt_token_ids) for c in outs if c.sample_index == 0))
        m.generated_tokens.inc(sum(len(c.token_ids) for c in outs))
        for c in outs:
            m.completions.labels(c.finish_reason).inc()
        return outs

    @app.post("/generate", response_model=list[Completion], tags=["native"])
    async def generate(body: GenerateRequest) -> Response:
        """Token-in/token-out (or text/chat-in) generation with the core's request and output types."""
        outs = await run(body)
        return Response(_COMPLETIONS.dump_json(outs), media_type="application/json")

    @app.post("/v1/completions", response_model=oai.CompletionResponse, tags=["openai"])
    async def completions(body: oai.CompletionRequest) -> oai.CompletionResponse:
        outs = await run(body.to_core())
        limits = state.get_limits()
        return oai.completion_response(outs, state.model_name, body.n, body.logprobs is not None, limits.decode_token)

    @app.post("/v1/chat/completions", response_model=oai.ChatCompletionResponse, tags=["openai"])
    async def chat_completions(body: oai.ChatCompletionRequest) -> oai.ChatCompletionResponse:
        outs = await run(body.to_core())
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
        other transport (gloo, nccl, shm, disk): the engine's workers join it directly."""
        if body.transport == "http":
            await state.ingress.open(body)
        else:
            await engine.init_weight_transfer(body)
        return ok()

    @app.post("/weights/update", response_model=VersionBody, tags=["weights"])
    async def weights_update(body: WeightManifest) -> VersionBody:
        """Receive one update described by the manifest; answers once it is applied (or rejected)."""
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
                  "auth": bool(api_key), "relay": relay_transport(engine)}
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

    return Guard(app, api_key=api_key, max_body_bytes=max_body_bytes, max_bucket_bytes=max_bucket_bytes,
                 metrics=state.metrics)


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
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
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
    ns = build_parser().parse_args(args)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = ns.api_key or os.environ.get(API_KEY_ENV) or None
    if ns.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logger.warning("serving on %s without an API key: anyone who can reach this port can push weights", ns.host)
    options = dict(ns.option)
    logger.info("starting a '%s' engine on %s", ns.backend, ns.model)
    if ns.factory:
        from rollout_engines.plugins import _import_target
        from rollout_engines.types import EngineConfig

        fields = set(EngineConfig.model_fields)
        config = EngineConfig(backend=ns.backend, model=ns.model, **{k: v for k, v in options.items() if k in fields},
                              options={k: v for k, v in options.items() if k not in fields})
        engine = _import_target(ns.factory)(config)
    else:
        engine = create_engine(ns.backend, model=ns.model, **options)
    app = create_app(engine, api_key=api_key, max_body_bytes=ns.max_body_bytes, max_bucket_bytes=ns.max_bucket_bytes,
                     model_name=ns.served_model_name, close_timeout_s=ns.grace_period,
                     exit_process_on_close_timeout=True)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(), lifespan="on",
                            timeout_graceful_shutdown=ns.grace_period, access_log=False, backlog=4096,
                            limit_concurrency=None)
    server = _graceful_server_class()(config)
    server.run()
    logger.info("server stopped")
    return 0


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
