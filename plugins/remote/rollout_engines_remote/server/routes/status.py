"""Status: the engine's info (with what a remote client needs), health, diagnostics, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from rollout_engines.types import Diagnostics, EngineInfo

from ...metrics import CONTENT_TYPE
from ...protocol import HealthBody
from ...transport import relay_transport
from ..state import ServerState


def router(state: ServerState) -> APIRouter:
    r = APIRouter(tags=["status"])
    engine = state.engine

    @r.get("/info", response_model=EngineInfo)
    async def info() -> EngineInfo:
        """The served engine's info; ``extra.server`` adds what a remote client needs."""
        base = await engine.info()
        caps = dict(base.capabilities)
        transports = list(caps.get("transports", []))
        if relay_transport(engine) is not None and "http" not in transports:
            transports.append("http")
        caps["transports"] = transports
        server = {"weight_receivers": engine.weight_receivers(), "model_name": state.model_name,
                  "auth": state.auth, "relay": relay_transport(engine), "weights_root": state.weights_root,
                  "protocols": list(state.protocols)}
        return base.model_copy(update={"capabilities": caps, "extra": {**base.extra, "server": server}})

    @r.get("/health", response_model=HealthBody, responses={503: {"model": HealthBody}})
    async def health() -> Response:
        healthy = await engine.health()
        body = HealthBody(status="ok" if healthy else "unavailable", weight_version=engine.weight_version)
        return JSONResponse(body.model_dump(), status_code=200 if healthy else 503)

    @r.get("/diagnostics", response_model=Diagnostics)
    async def diagnostics(fingerprint: bool = False) -> Diagnostics:
        """The served engine's :meth:`~rollout_engines.engine.EngineProtocol.diagnostics`."""
        return await engine.diagnostics(fingerprint=fingerprint)

    @r.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        state.metrics.weight_version.set(engine.weight_version)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return r
