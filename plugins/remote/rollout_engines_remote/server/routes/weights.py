"""Weight sync: join a trainer's session, receive updates (``http`` frames relayed through the
server's ingress, or the engine's own transports), abort, close, version."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from rollout_engines.weights.manifest import TransportSpec, WeightManifest

from ...protocol import AbortBody, OkBody, VersionBody
from ..errors import Conflict, FieldError
from ..frames import read_bucket_frame
from ..state import ServerState, check_store_options, confine_disk_spec

BUCKET_BODY = {"requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                               "required": True}}


def router(state: ServerState) -> APIRouter:
    r = APIRouter(tags=["weights"])
    engine = state.engine

    def ok() -> OkBody:
        return OkBody(weight_version=engine.weight_version)

    @r.post("/weights/init", response_model=OkBody)
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
            body = confine_disk_spec(body, state.weights_root)
        if body.transport in engine.capabilities.transports:  # else the engine's refusal says why
            check_store_options(body)
        state.init_started = time.monotonic()
        try:
            if body.transport == "http":
                await state.ingress.open(body)
            else:
                await engine.init_weight_transfer(body)
        finally:
            state.init_started = None
        return ok()

    @r.post("/weights/update", response_model=VersionBody)
    async def weights_update(body: WeightManifest) -> VersionBody:
        """Receive one update described by the manifest; answers once it is applied (or rejected).
        A manifest with ``lora`` is a LoRA adapter (``WeightSync.push_lora``): the answer's
        ``weight_version`` is then the adapter's version, and the base weights are untouched."""
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
        if body.lora is None:  # a LoRA push's version is its adapter's
            state.metrics.weight_version.set(version)
        return VersionBody(weight_version=version)

    @r.post("/weights/bucket", response_model=OkBody, openapi_extra=BUCKET_BODY)
    async def weights_bucket(request: Request) -> OkBody:
        """One ``http`` transport frame: a safetensors file with one U8 tensor, the bucket."""
        meta, buf = await read_bucket_frame(request.stream(), request.headers.get("content-length"))
        state.metrics.weight_bytes.inc(buf.numel())
        await state.ingress.feed(meta, buf)
        return ok()

    @r.post("/weights/abort", response_model=OkBody)
    async def weights_abort(body: AbortBody) -> OkBody:
        await state.ingress.abort(body.session, body.update, body.reason)
        return ok()

    @r.post("/weights/close", response_model=OkBody)
    async def weights_close() -> OkBody:
        await state.ingress.close()
        await engine.close_weight_transfer()
        return ok()

    @r.get("/weights/version", response_model=VersionBody)
    async def weights_version() -> VersionBody:
        return VersionBody(weight_version=engine.weight_version)

    return r
