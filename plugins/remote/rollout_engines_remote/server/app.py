"""``create_app``: the FastAPI app serving one engine (its state, error handlers and routers),
wrapped in the :class:`~.guard.Guard`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from rollout_engines.engine import Engine
from rollout_engines.errors import RolloutEnginesError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..protocol import ERROR_STATUS, ErrorBody
from .errors import (
    BodyReadTimeout,
    ClientDisconnected,
    Conflict,
    FieldError,
    Forbidden,
    error_response,
    validation_response,
)
from .guard import Guard, allowed_hosts_for
from .limits import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BUCKET_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_SEQUENCES,
)
from .routes import DEFAULT_PROTOCOLS, check_protocols, routers
from .state import ServerState

logger = logging.getLogger("rollout_engines.remote.server")


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
    protocols: Sequence[str] = DEFAULT_PROTOCOLS,
) -> Any:
    """The ASGI app serving ``engine``.

    Every endpoint but ``/health`` needs ``Authorization: Bearer <api_key>``; serving without a key
    needs ``insecure_no_auth=True`` (anyone who reaches the port can then push weights). Requests
    must carry a ``Host`` the server answers to: loopback names, ``bind_host`` (the address the
    server listens on) and ``allowed_hosts`` (``["*"]``: no check). ``disk`` weight transfers must
    use a folder inside ``weights_root`` (none: refused). ``max_concurrency`` requests at once
    (beyond: 503); request bodies must arrive within ``body_read_timeout_s`` (408).
    ``close_engine``: close the engine when the app shuts down, waiting at most ``close_timeout_s``
    for work it is still doing (then the process exits anyway). ``protocols``: the APIs served,
    ``native`` (``/generate``, ``/generate/stream``, ``/abort``, control plane, weight sync) and/or
    ``openai`` (``/v1/*``); ``/info``, ``/health`` and ``/metrics`` always."""
    if not api_key and not insecure_no_auth:
        raise ValueError("create_app() needs api_key='...' (clients send 'Authorization: Bearer KEY'); to serve "
                         "without authentication, which lets anyone who reaches the port push weights, pass "
                         "insecure_no_auth=True")
    if api_key and insecure_no_auth:
        raise ValueError("pass either api_key= or insecure_no_auth=True, not both")
    if insecure_no_auth:
        logger.warning("serving WITHOUT authentication (insecure_no_auth): anyone who can reach this server can "
                       "generate, sleep it and push weights into it")
    chosen = check_protocols(protocols)
    hosts = allowed_hosts_for(bind_host, allowed_hosts)
    root = None
    if weights_root is not None:
        root = os.path.realpath(os.fspath(weights_root))
        if not os.path.isdir(root):
            raise ValueError(f"weights_root {weights_root} is not an existing folder")
    state = ServerState(engine, model_name or engine.config.model, max_sequences, api_key=api_key,
                        weights_root=root, protocols=chosen)

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
    install_error_handlers(app)
    paths: set[str] = set()
    for router in routers(state, chosen):
        paths.update(route.path for route in router.routes if isinstance(route, APIRoute))
        app.include_router(router)
    return Guard(_Answered(app), api_key=api_key or None, max_body_bytes=max_body_bytes, max_bucket_bytes=max_bucket_bytes,
                 metrics=state.metrics, allowed_hosts=hosts, max_concurrency=max_concurrency,
                 body_read_timeout_s=body_read_timeout_s, known_paths=paths)


class _Answered:
    """Ends an unexpected error that was already answered. Starlette answers it with the handler's
    500 (``install_error_handlers``, which logs it) and then raises it again for the server, and
    uvicorn then closes the connection: a client's pooled keep-alive connection breaks, and a
    request it sends on it at that moment fails with no answer. An error raised before its answer
    is complete still reaches the server (the answer is broken: the connection must close)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:  # the FastAPI app's own (state, routes, ...)
        return getattr(self.app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        answered = False

        async def watch(message: Any) -> None:
            nonlocal answered
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if not answered:
                raise


def install_error_handlers(app: FastAPI) -> None:
    """Every error as ``{"error": {"type", "message", "param"}}``, client mistakes as 4xx."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc.errors())

    @app.exception_handler(ValidationError)
    async def _on_pydantic(request: Request, exc: ValidationError) -> JSONResponse:
        return validation_response(exc.errors())

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
    return cast(FastAPI, app.app if isinstance(app, Guard) else app)
