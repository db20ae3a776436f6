"""The OpenAI-compatible API: ``/v1/completions``, ``/v1/chat/completions`` (plain or
``stream: true``) and ``/v1/models``.

Streaming: an engine with the ``streaming`` capability (and a transformers tokenizer at its model
path) streams its deltas, detokenized here as the engine makes its text (stop strings cut,
incomplete characters held back); other engines generate first and then send each choice in one
chunk, so the reassembled text always equals the non-streamed one for the latter. Every choice's
last chunk carries its ``finish_reason``; ``stream_options.include_usage`` adds a last chunk with
the usage; ``return_token_ids`` adds each chunk's ``token_ids`` (and ``prompt_token_ids`` on a
choice's first chunk, where known: always, except text and chat prompts of a streaming engine).

LoRA adapters (pushed with ``WeightSync.push_lora``, or loaded with vLLM's ``/v1/load_lora_adapter``,
:mod:`.lora`): ``"model": "<adapter name>"`` generates with that adapter and answers name it;
``/v1/models`` lists each loaded adapter with ``parent`` = the served model, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from pydantic import field_validator
from rollout_engines.types import Completion, GenerateRequest, StreamDelta, TokenLogprob

from ... import openai_api as oai
from ..sse import EventStreamResponse, event, events_of, first_item
from ..state import ServerState

#: What vLLM's OpenAI server sends for a logprob of ``-inf`` (a masked token): ``max(logprob, -9999.0)``.
#: JSON has no ``-inf`` (it went out as ``null``, which clients that sum or sort logprobs, lm-eval and
#: TRL's ``VLLMClient``, fail on).
MIN_LOGPROB = -9999.0


def _low(values: Sequence[float | None] | None) -> bool:
    return values is not None and any(v is not None and v < MIN_LOGPROB for v in values)


def _clamp(value: float) -> float:
    return MIN_LOGPROB if value < MIN_LOGPROB else value


def _clamp_tops(tops: list[list[TokenLogprob]]) -> list[list[TokenLogprob]]:
    return [[e.model_copy(update={"logprob": MIN_LOGPROB}) if e.logprob < MIN_LOGPROB else e for e in step]
            for step in tops]


def _low_tops(tops: list[list[TokenLogprob]] | None) -> bool:
    return tops is not None and any(_low([e.logprob for e in step]) for step in tops)


def clamp_logprobs(outs: list[Completion]) -> list[Completion]:
    """``outs`` with every logprob below :data:`MIN_LOGPROB` (``-inf``) raised to it, as vLLM answers."""
    out = []
    for c in outs:
        update: dict[str, Any] = {}
        if c.logprobs is not None and _low(c.logprobs):
            update["logprobs"] = [_clamp(v) for v in c.logprobs]
        if c.prompt_logprobs is not None and _low(c.prompt_logprobs):
            update["prompt_logprobs"] = [None if v is None else _clamp(v) for v in c.prompt_logprobs]
        if c.top_logprobs is not None and _low_tops(c.top_logprobs):
            update["top_logprobs"] = _clamp_tops(c.top_logprobs)
        if c.prompt_top_logprobs is not None and _low_tops(c.prompt_top_logprobs):
            update["prompt_top_logprobs"] = _clamp_tops(c.prompt_top_logprobs)
        out.append(c.model_copy(update=update) if update else c)
    return out


def clamp_delta(d: StreamDelta) -> StreamDelta:
    """:func:`clamp_logprobs` for one streamed delta."""
    update: dict[str, Any] = {}
    if d.logprobs is not None and _low(d.logprobs):
        update["logprobs"] = [_clamp(v) for v in d.logprobs]
    if d.top_logprobs is not None and _low_tops(d.top_logprobs):
        update["top_logprobs"] = _clamp_tops(d.top_logprobs)
    return d.model_copy(update=update) if update else d


class ChatRequest(oai.ChatCompletionRequest):
    """``/v1/chat/completions``'s body. A message's ``content`` may also be a list of text parts
    (``[{"type": "text", "text": ...}, ...]``, the OpenAI API's other form): served as their texts
    joined by newlines, as vLLM joins them; a part of another type (an image) is refused, naming it."""

    @field_validator("messages", mode="before")
    @classmethod
    def _text_parts(cls, messages: Any) -> Any:
        if not isinstance(messages, list):
            return messages
        out = []
        for i, m in enumerate(messages):
            parts = m.get("content") if isinstance(m, dict) else None
            if isinstance(parts, list):
                texts = []
                for j, part in enumerate(parts):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind != "text" or not isinstance(part.get("text"), str):
                        raise ValueError(f"messages.{i}.content.{j}: a content part of type {str(kind)[:40]!r} is "
                                         "not served; this server takes text only ({'type': 'text', 'text': ...} "
                                         "parts, or a string)")
                    texts.append(part["text"])
                m = {**m, "content": "\n".join(texts)}
            out.append(m)
        return out


STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {200: {"description": "JSON, or with stream=true server-sent events of chunks, then "
                                         "`data: [DONE]`.",
                          "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


@dataclass
class Piece:
    """New output of one choice: its text and tokens since its last piece."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[TokenLogprob]] | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    first: bool = False
    usage: dict[str, int] = field(default_factory=dict)


def router(state: ServerState) -> APIRouter:
    r = APIRouter(tags=["openai"])
    engine = state.engine

    def decode_ids(ids: list[int]) -> str:
        tok = state.get_limits().tokenizer
        return str(tok.decode(ids, skip_special_tokens=True))

    async def pieces(req: GenerateRequest) -> AsyncGenerator[Piece, None]:
        """The request's output as pieces, choice index = prompt_index * n + sample_index."""
        n = req.sampling.n
        streams = engine.capabilities.streaming and state.get_limits().tokenizer is not None
        if not streams:
            outs = await engine.generate(req)
            state.count(outs)
            for i, c in enumerate(clamp_logprobs(outs)):
                yield Piece(i, c.text, list(c.token_ids), c.logprobs, c.top_logprobs, c.finish_reason,
                            list(c.prompt_token_ids), first=True,
                            usage={"prompt": len(c.prompt_token_ids) if c.sample_index == 0 else 0,
                                   "completion": len(c.token_ids)})
            return
        texts: dict[int, oai.TextDelta] = {}
        s = req.sampling
        read_prompt = state.prompt_reader(req)
        source = engine.stream(req)
        try:
            async for d in source:
                index = d.prompt_index * n + d.sample_index
                first = index not in texts
                if first:
                    texts[index] = oai.TextDelta(decode_ids, s.stop, s.stop_token_ids)
                text = texts[index].push(d.token_ids, d.finish_reason)
                usage = {"completion": len(d.token_ids)}
                prompt_ids = None
                if first:
                    prompt_ids = await read_prompt(d.prompt_index)
                    usage["prompt"] = len(prompt_ids or ()) if d.sample_index == 0 else 0
                state.count_delta(d, prompt_ids if d.sample_index == 0 else None)  # None after the first delta
                d = clamp_delta(d)
                yield Piece(index, text, list(d.token_ids), d.logprobs, d.top_logprobs, d.finish_reason,
                            prompt_ids, first=first, usage=usage)
        finally:
            await source.aclose()

    async def start(req: GenerateRequest, request: Request) -> tuple[Piece | None, AsyncGenerator[Piece, None]]:
        state.get_limits().check(req)
        source = pieces(req)
        return await first_item(request, source), source

    def core_request(body: oai.CompletionRequest | oai.ChatCompletionRequest) -> tuple[GenerateRequest, str]:
        """The core request, and the model its answers name: ``model`` naming a loaded LoRA adapter
        selects it (vLLM's runtime LoRA); any other name is the served model (clients such as
        lm-eval name it as they like)."""
        req = body.to_core(engine.capabilities)
        if body.model and body.model in engine.loras:
            return req.model_copy(update={"lora": body.model}), body.model
        return req, state.model_name

    def usage_of(totals: dict[str, int]) -> oai.Usage:
        p, c = totals.get("prompt", 0), totals.get("completion", 0)
        return oai.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def add(totals: dict[str, int], piece: Piece) -> None:
        for k, v in piece.usage.items():
            totals[k] = totals.get(k, 0) + v

    # ---- /v1/completions ---------------------------------------------------------------------
    def prompt_text(body: oai.CompletionRequest) -> Callable[[Completion], str]:
        p = body.prompt
        texts = [p] if isinstance(p, str) else list(p) if p and all(isinstance(x, str) for x in p) else None

        def text(c: Completion) -> str:
            if texts is not None:
                return str(texts[c.prompt_index])
            tok = state.get_limits().tokenizer
            if tok is None:
                return "".join(state.get_limits().decode_token(t) for t in c.prompt_token_ids)
            return str(tok.decode(c.prompt_token_ids))

        return text

    @r.post("/v1/completions", response_model=oai.CompletionResponse, responses=STREAM_RESPONSES)
    async def completions(body: oai.CompletionRequest, request: Request) -> Any:
        req, model = core_request(body)
        if body.stream:
            first, source = await start(req, request)
            return EventStreamResponse(events_of(completion_chunks(body, model, first, source)))
        outs = clamp_logprobs(await state.generate(req, request))
        limits = state.get_limits()
        return oai.completion_response(outs, model, body, body.token_names(limits.decode_token), prompt_text(body))

    async def completion_chunks(body: oai.CompletionRequest, model: str, first: Piece | None,
                                source: AsyncGenerator[Piece, None]) -> AsyncGenerator[bytes, None]:
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        decode = body.token_names(state.get_limits().decode_token)
        offsets: dict[int, int] = {}
        totals: dict[str, int] = {}
        try:
            piece = first
            while piece is not None:
                add(totals, piece)
                logprobs = None
                if body.logprobs is not None and piece.logprobs is not None:
                    logprobs = oai.completion_logprobs(piece.token_ids, list(piece.logprobs), piece.top_logprobs,
                                                       decode, offsets.get(piece.index, 0))
                offsets[piece.index] = offsets.get(piece.index, 0) + len(piece.text)
                choice = oai.CompletionStreamChoice(
                    index=piece.index, text=piece.text, logprobs=logprobs, finish_reason=piece.finish_reason,
                    token_ids=piece.token_ids if body.return_token_ids else None,
                    prompt_token_ids=piece.prompt_token_ids if body.return_token_ids and piece.first else None)
                chunk = oai.CompletionChunk(id=cid, created=created, model=model, choices=[choice])
                yield event(chunk.model_dump_json())
                piece = await anext(source, None)
            if body.include_usage:
                chunk = oai.CompletionChunk(id=cid, created=created, model=model, choices=[],
                                            usage=usage_of(totals))
                yield event(chunk.model_dump_json())
        finally:
            await source.aclose()

    # ---- /v1/chat/completions ------------------------------------------------------------------
    @r.post("/v1/chat/completions", response_model=oai.ChatCompletionResponse, responses=STREAM_RESPONSES)
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        req, model = core_request(body)
        if body.stream:
            first, source = await start(req, request)
            return EventStreamResponse(events_of(chat_chunks(body, model, first, source)))
        outs = clamp_logprobs(await state.generate(req, request))
        return oai.chat_response(outs, model, body, body.token_names(state.get_limits().decode_token))

    async def chat_chunks(body: oai.ChatCompletionRequest, model: str, first: Piece | None,
                          source: AsyncGenerator[Piece, None]) -> AsyncGenerator[bytes, None]:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        decode = body.token_names(state.get_limits().decode_token)
        totals: dict[str, int] = {}
        started: set[int] = set()
        sent_prompt = False

        def chunk(choices: list[oai.ChatStreamChoice], **extra: Any) -> bytes:
            c = oai.ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, **extra)
            return event(c.model_dump_json())

        try:
            piece = first
            while piece is not None:
                add(totals, piece)
                extra: dict[str, Any] = {}
                if body.return_token_ids and not sent_prompt and piece.prompt_token_ids is not None:
                    extra["prompt_token_ids"], sent_prompt = piece.prompt_token_ids, True
                if piece.index not in started:  # the role first, as OpenAI sends it
                    started.add(piece.index)
                    yield chunk([oai.ChatStreamChoice(index=piece.index,
                                                      delta=oai.ChatDelta(role="assistant", content=""))], **extra)
                    extra = {}
                logprobs = None
                if body.logprobs and piece.logprobs is not None:
                    logprobs = oai.chat_logprobs(piece.token_ids, piece.logprobs, piece.top_logprobs, decode)
                choice = oai.ChatStreamChoice(index=piece.index, delta=oai.ChatDelta(content=piece.text),
                                              logprobs=logprobs, finish_reason=piece.finish_reason,
                                              token_ids=piece.token_ids if body.return_token_ids else None)
                yield chunk([choice], **extra)
                piece = await anext(source, None)
            if body.include_usage:
                yield chunk([], usage=usage_of(totals))
        finally:
            await source.aclose()

    @r.get("/v1/models", response_model=oai.ModelList)
    async def models() -> oai.ModelList:
        """The served model, then every loaded LoRA adapter (``parent``: the served model), as vLLM lists them."""
        base = oai.ModelCard(id=state.model_name, created=int(state.started))
        now = int(time.time())
        adapters = [oai.ModelCard(id=name, created=now, parent=state.model_name) for name in sorted(engine.loras)]
        return oai.ModelList(data=[base, *adapters])

    return r
