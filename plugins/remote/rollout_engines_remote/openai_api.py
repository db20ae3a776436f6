"""OpenAI-compatible request and response shapes, translated to and from the core's types.

``/v1/completions`` and ``/v1/chat/completions``, plain or streamed (``stream: true``: server-sent
events of ``*.chunk`` objects, then ``data: [DONE]``); fields the OpenAI API has and this server
ignores (penalties, ``user``) are accepted and ignored so stock clients work. vLLM's extra fields
are honoured: ``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``
(``prompt_token_ids`` and ``token_ids`` in the answer; ``token_ids`` of a completion choice are
always there), ``prompt_logprobs``.

Log-likelihood scoring (lm-eval's ``local-completions``): ``/v1/completions`` with ``echo: true``
and ``logprobs: k`` returns the prompt's tokens with their logprobs (the first ``None``) and the k
most likely tokens per position, followed by the generated ones, in OpenAI's ``logprobs`` shape.
``max_tokens: 0`` is accepted with ``echo`` (the prompt only): the core generates at least one
token, so the server generates one and drops it. Needs the engine's ``prompt_logprobs`` capability (else 400
``CapabilityError``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from rollout_engines.engine import Capabilities
from rollout_engines.errors import CapabilityError
from rollout_engines.types import (
    MAX_LOGPROBS,
    ChatMessage,
    Completion,
    GenerateRequest,
    SamplingParams,
    TokenLogprob,
)

from .server.errors import FieldError

Decode = Callable[[int], str]


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _OpenAIRequest(BaseModel):
    # Unknown OpenAI fields are ignored, not rejected: clients send 'user', penalties, etc.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0, description="0 only with echo (completions).")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool | None = Field(
        default=None, description="vLLM extra: add prompt_token_ids (and token_ids) to the answer.")
    return_tokens_as_token_ids: bool = Field(
        default=False, description="vLLM extra: name logprob tokens 'token_id:N' instead of their text.")

    def sampling(self, logprobs: int | None, max_tokens: int | None, *, top_logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
        if max_tokens == 0 or (max_tokens is None and self.max_tokens == 0):
            raise FieldError("max_tokens", "must be at least 1 (0 only with echo=true on /v1/completions)")
        return SamplingParams(
            # top_k 0 disables top-k, as in vLLM's API (TRL's client sends it): SamplingParams reads it so.
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_tokens=max_tokens or self.max_tokens or 16,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, seed=self.seed,
            logprobs=logprobs, n=self.n, top_logprobs=top_logprobs or None, prompt_logprobs=prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def token_names(self, decode: Decode) -> Decode:
        """How logprob tokens are named in the answer: ``decode`` (their text), or ``token_id:N``
        with ``return_tokens_as_token_ids`` (vLLM's extra; TRL's client parses the ids from it)."""
        return _token_id_name if self.return_tokens_as_token_ids else decode


class CompletionRequest(_OpenAIRequest):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(default=False, description="Prepend the prompt to each choice's text (and its logprobs).")
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="vLLM extra: each choice's prompt_logprobs.")

    @property
    def drop_generated(self) -> bool:
        """``echo`` with ``max_tokens=0``: the prompt only (the one token generated is dropped)."""
        return self.echo and self.max_tokens == 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (self.echo and self.logprobs is not None) or self.prompt_logprobs is not None

    def to_core(self, caps: Capabilities | None = None) -> GenerateRequest:
        """The core request; ``caps``: the engine's, to ask for top logprobs only where served."""
        p = self.prompt
        if self.echo and self.stream:
            raise FieldError("echo", "echo is not served with stream=true; send stream=false")
        k = self.logprobs or 0
        prompt_k: int | None = None
        if self.wants_prompt_logprobs:
            if caps is not None and not caps.prompt_logprobs:
                what = "echo=true with logprobs" if self.echo and self.logprobs is not None else "prompt_logprobs"
                raise CapabilityError(f"{what} needs the prompt's logprobs, which this server's engine does not "
                                      "return (capability 'prompt_logprobs'); send logprobs without echo, or "
                                      "serve another backend")
            prompt_k = max(k if self.echo else 0, self.prompt_logprobs or 0)
        top = k if caps is not None and k and caps.top_logprobs >= k else None
        max_tokens = 1 if self.drop_generated else None
        sampling = self.sampling(self.logprobs, max_tokens, top_logprobs=top, prompt_logprobs=prompt_k)
        if isinstance(p, str):
            return GenerateRequest(prompts=[p], sampling=sampling)
        if p and all(isinstance(x, int) for x in p):
            return GenerateRequest(prompt_token_ids=[list(p)], sampling=sampling)  # type: ignore[arg-type]
        if p and all(isinstance(x, str) for x in p):
            return GenerateRequest(prompts=list(p), sampling=sampling)  # type: ignore[arg-type]
        return GenerateRequest(prompt_token_ids=[list(x) for x in p], sampling=sampling)  # type: ignore[arg-type]


class ChatCompletionRequest(_OpenAIRequest):
    """``POST /v1/chat/completions`` (one conversation per request, as OpenAI's API)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def to_core(self, caps: Capabilities | None = None) -> GenerateRequest:
        k = self.top_logprobs or 0
        top = k if self.logprobs and caps is not None and k and caps.top_logprobs >= k else None
        sampling = self.sampling(1 if self.logprobs else None, self.max_completion_tokens, top_logprobs=top)
        return GenerateRequest(messages=[self.messages], sampling=sampling)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str
    token_ids: list[int] | None = Field(default=None, description="vLLM-style extra: the sampled token ids.")
    prompt_token_ids: list[int] | None = Field(default=None, description="vLLM extra (return_token_ids).")
    prompt_logprobs: list[dict[str, VllmLogprob] | None] | None = Field(
        default=None, description="vLLM extra (prompt_logprobs): per prompt position, token id -> logprob.")


class VllmLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str
    token_ids: list[int] | None = Field(default=None, description="vLLM extra (return_token_ids).")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = Field(default=None, description="vLLM extra (return_token_ids).")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rollout-engines"
    parent: str | None = Field(default=None, description="A LoRA adapter's base model (vLLM's field); None: a base model.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _usage(outs: Sequence[Completion], n: int) -> Usage:
    # Prompt tokens count once per prompt, not once per sample (as OpenAI and vLLM report it).
    prompt = sum(len(c.prompt_token_ids) for c in outs if c.sample_index == 0)
    completion = sum(len(c.token_ids) for c in outs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)




def _top_dict(entries: Sequence[TokenLogprob] | None, token: str, logprob: float, decode: Decode) -> dict[str, float]:
    """OpenAI's per-position ``top_logprobs`` dict: the chosen token and the k most likely ones."""
    top = {token: logprob}
    for e in entries or ():
        top.setdefault(decode(e.token_id), e.logprob)
    return top


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[float | None],
                        tops: Sequence[Sequence[TokenLogprob] | None] | None, decode: Decode,
                        offset: int = 0) -> CompletionLogprobs:
    """OpenAI's completions ``logprobs`` object; a position whose logprob is ``None`` (the first
    prompt token) has ``None`` as its top dict too."""
    tokens = [decode(t) for t in token_ids]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top_list: list[dict[str, float] | None] = []
    for j, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        top_list.append(None if lp is None else _top_dict(tops[j] if tops else None, tok, lp, decode))
    return CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), top_logprobs=top_list,
                              text_offset=offsets)


def _vllm_prompt_logprobs(c: Completion, decode: Decode) -> list[dict[str, VllmLogprob] | None] | None:
    if c.prompt_logprobs is None:
        return None
    out: list[dict[str, VllmLogprob] | None] = []
    tops = c.prompt_top_logprobs or []
    for j, (t, lp) in enumerate(zip(c.prompt_token_ids, c.prompt_logprobs, strict=False)):
        if lp is None:
            out.append(None)
            continue
        top = list(tops[j]) if j < len(tops) else []
        # vLLM ranks the prompt's own token too (TRL's client sorts on "rank"): its place among the
        # top entries, or one past those more likely than it (exact while k covers it).
        rank = next((r for r, e in enumerate(top, start=1) if e.token_id == t), None)
        if rank is None:
            rank = 1 + sum(1 for e in top if e.logprob > lp)
        entry = {str(t): VllmLogprob(logprob=lp, rank=rank, decoded_token=decode(t))}
        for r, e in enumerate(top, start=1):
            entry.setdefault(str(e.token_id), VllmLogprob(logprob=e.logprob, rank=r, decoded_token=decode(e.token_id)))
        out.append(entry)
    return out


def completion_response(outs: Sequence[Completion], model: str, body: CompletionRequest, decode: Decode,
                        prompt_text: Callable[[Completion], str] | None = None) -> CompletionResponse:
    """The ``/v1/completions`` answer. ``echo``: the prompt (``prompt_text(c)``) before the text and,
    with ``logprobs``, the prompt's tokens before the generated ones (nothing generated when
    ``max_tokens`` was 0)."""
    choices = []
    want_logprobs = body.logprobs is not None
    for i, c in enumerate(outs):
        token_ids = [] if body.drop_generated else list(c.token_ids)
        text = "" if body.drop_generated else c.text
        finish = "length" if body.drop_generated else c.finish_reason
        logprobs = None
        gen_lps: list[float | None] = list(c.logprobs or []) if not body.drop_generated else []
        gen_tops = list(c.top_logprobs or []) if c.top_logprobs and not body.drop_generated else None
        if body.echo:
            head = prompt_text(c) if prompt_text is not None else ""
            if want_logprobs:
                p_lps = list(c.prompt_logprobs or [None] * len(c.prompt_token_ids))
                p_tops: list[Sequence[TokenLogprob] | None] = (
                    list(c.prompt_top_logprobs) if c.prompt_top_logprobs else [None] * len(p_lps)
                )
                gen: list[Sequence[TokenLogprob] | None] = list(gen_tops) if gen_tops is not None else [None] * len(gen_lps)
                tops = p_tops + gen
                logprobs = completion_logprobs(list(c.prompt_token_ids) + token_ids, p_lps + gen_lps, tops, decode)
            text = head + text
        elif want_logprobs and c.logprobs is not None:
            logprobs = completion_logprobs(token_ids, gen_lps, gen_tops, decode)
        choices.append(CompletionChoice(
            index=i, text=text, logprobs=logprobs, finish_reason=finish, token_ids=token_ids,
            prompt_token_ids=list(c.prompt_token_ids) if body.return_token_ids else None,
            prompt_logprobs=_vllm_prompt_logprobs(c, decode) if body.prompt_logprobs is not None else None))
    usage = _usage(outs, body.n)
    if body.drop_generated:
        usage = Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=0, total_tokens=usage.prompt_tokens)
    return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                              choices=choices, usage=usage)


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[Sequence[TokenLogprob]] | None, decode: Decode) -> ChatChoiceLogprobs:
    content = []
    for j, (t, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        tok = decode(t)
        top = [{"token": decode(e.token_id), "logprob": e.logprob, "bytes": list(decode(e.token_id).encode("utf-8"))}
               for e in (tops[j] if tops and j < len(tops) else ())]
        content.append(ChatTokenLogprob(token=tok, logprob=lp, bytes=list(tok.encode("utf-8")), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def chat_response(outs: Sequence[Completion], model: str, body: ChatCompletionRequest,
                  decode: Decode) -> ChatCompletionResponse:
    choices = []
    for i, c in enumerate(outs):
        logprobs = None
        if body.logprobs and c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, decode)
        choices.append(ChatChoice(index=i, message=AssistantMessage(content=c.text), logprobs=logprobs,
                                  finish_reason=c.finish_reason,
                                  token_ids=list(c.token_ids) if body.return_token_ids else None))
    prompt_ids = list(outs[0].prompt_token_ids) if body.return_token_ids and outs else None
    return ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                  choices=choices, usage=_usage(outs, body.n), prompt_token_ids=prompt_ids)


# ---- streaming -----------------------------------------------------------------------------------
class TextDelta:
    """Incremental detokenization of one streamed sequence, as the engine makes its text: special
    tokens skipped, a trailing incomplete character held back, and the text cut where a stop string
    begins (the last ``len(longest stop) - 1`` characters are held back until it is known that no
    stop string starts in them). A stop token (``stop_token_ids``) that ends the sequence is left out."""

    def __init__(self, decode_ids: Callable[[list[int]], str], stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = ()) -> None:
        self.decode_ids = decode_ids
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stop_token_ids = frozenset(stop_token_ids)
        self.ids: list[int] = []
        self.sent = 0
        self.done = False

    def push(self, token_ids: Sequence[int], finish_reason: str | None) -> str:
        if self.done:
            return ""
        self.ids.extend(token_ids)
        final = finish_reason is not None
        ids = self.ids
        if final and finish_reason == "stop" and ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        text = self.decode_ids(ids)
        if not final and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        limit = len(text) if final else max(self.sent, len(text) - self.hold)
        if self.stop:
            start = max(0, self.sent - self.hold)
            hits = [j for j in (text.find(s, start) for s in self.stop) if j >= 0]
            if hits:
                limit, final = min(hits), True
        out = text[self.sent:max(self.sent, limit)]
        self.sent = max(self.sent, limit)
        self.done = final
        return out
