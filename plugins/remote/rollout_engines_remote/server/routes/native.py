"""The native generation API: the core's ``GenerateRequest`` in, its ``Completion`` /
``StreamDelta`` objects out; ``/abort`` ends running requests by id."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import TypeAdapter
from rollout_engines.types import Completion, GenerateRequest, StreamDelta

from ...protocol import AbortRequestsBody, OkBody
from ..sse import EventStreamResponse, event, events_of, first_item
from ..state import ServerState

_COMPLETIONS = TypeAdapter(list[Completion])

STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {200: {"description": "Server-sent events: `data: <StreamDelta JSON>` per delta, then "
                                         "`data: [DONE]`; an error after the start is a `data: {\"error\": ...}` event.",
                          "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def router(state: ServerState) -> APIRouter:
    r = APIRouter(tags=["native"])
    engine = state.engine

    @r.post("/generate", response_model=list[Completion])
    async def generate(body: GenerateRequest, request: Request) -> Response:
        """Token-in/token-out (or text/chat-in) generation with the core's request and output types."""
        outs = await state.generate(body, request)
        return Response(_COMPLETIONS.dump_json(outs), media_type="application/json")

    @r.post("/generate/stream", responses=STREAM_RESPONSES)
    async def generate_stream(body: GenerateRequest, request: Request) -> Response:
        """``Engine.stream``: one ``StreamDelta`` event per delta (the last one of each sequence has its
        ``finish_reason``), then ``[DONE]``. Set ``request_ids`` to abort sequences by id. The engine
        runs only as fast as the client reads; a client that disconnects cancels the generation.
        Engines without the ``streaming`` capability send each sequence whole when it is done."""
        state.get_limits().check(body)
        source = engine.stream(body)
        first = await first_item(request, source)
        count = state.delta_counter(body)

        async def deltas() -> AsyncGenerator[bytes, None]:
            try:
                delta: StreamDelta | None = first
                while delta is not None:
                    await count(delta)
                    yield event(delta.model_dump_json())
                    delta = await anext(source, None)
            finally:
                await source.aclose()

        return EventStreamResponse(events_of(deltas()))

    @r.post("/abort", response_model=OkBody)
    async def abort(body: AbortRequestsBody) -> OkBody:
        """End running requests now (their results or last deltas carry ``finish_reason="abort"``):
        ``{"request_ids": [...]}`` (unknown or finished ids are ignored) or ``{"all": true}``. Needs
        the engine's ``abort`` capability (400 otherwise)."""
        if body.all:
            await engine.abort_all()
        else:
            await engine.abort(body.request_ids or [])
        return OkBody(weight_version=engine.weight_version)

    return r
