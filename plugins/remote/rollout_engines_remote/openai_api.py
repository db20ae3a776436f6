"""OpenAI-compatible request and response shapes, translated to and from the core's types.

Only the non-streaming forms of ``/v1/completions`` and ``/v1/chat/completions``; fields the
OpenAI API has and this server ignores (penalties, ``user``) are accepted and ignored so stock
clients work. vLLM's extra sampling fields (``top_k``, ``min_p``, ``stop_token_ids``,
``ignore_eos``) are honoured.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from rollout_engines.types import ChatMessage, Completion, GenerateRequest, SamplingParams


class _OpenAIRequest(BaseModel):
    # Unknown OpenAI fields are ignored, not rejected: clients send 'user', penalties, etc.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported by this server; send stream=false")
        return v

    def sampling(self, logprobs: int | None, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_tokens=max_tokens or self.max_tokens or 16, stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, seed=self.seed,
            logprobs=logprobs, n=self.n,
        )


class CompletionRequest(_OpenAIRequest):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False

    def to_core(self) -> GenerateRequest:
        p = self.prompt
        sampling = self.sampling(self.logprobs, None)
        if isinstance(p, str):
            return GenerateRequest(prompts=[p], sampling=sampling)
        if p and all(isinstance(x, int) for x in p):
            return GenerateRequest(prompt_token_ids=[list(p)], sampling=sampling)  # type: ignore[arg-type]
        if p and all(isinstance(x, str) for x in p):
            return GenerateRequest(prompts=list(p), sampling=sampling)  # type: ignore[arg-type]
        return GenerateRequest(prompt_token_ids=[list(x) for x in p], sampling=sampling)  # type: ignore[union-attr]


class ChatCompletionRequest(_OpenAIRequest):
    """``POST /v1/chat/completions`` (one conversation per request, as OpenAI's API)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def to_core(self) -> GenerateRequest:
        sampling = self.sampling(1 if self.logprobs else None, self.max_completion_tokens)
        return GenerateRequest(messages=[self.messages], sampling=sampling)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str
    token_ids: list[int] | None = Field(default=None, description="vLLM-style extra: the sampled token ids.")


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


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rollout-engines"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _usage(outs: Sequence[Completion], n: int) -> Usage:
    # Prompt tokens count once per prompt, not once per sample (as OpenAI and vLLM report it).
    prompt = sum(len(c.prompt_token_ids) for c in outs if c.sample_index == 0)
    completion = sum(len(c.token_ids) for c in outs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_response(
    outs: Sequence[Completion], model: str, n: int, want_logprobs: bool, decode: Callable[[int], str]
) -> CompletionResponse:
    choices = []
    for i, c in enumerate(outs):
        logprobs = None
        if want_logprobs and c.logprobs is not None:
            tokens = [decode(t) for t in c.token_ids]
            offsets, pos = [], 0
            for tok in tokens:
                offsets.append(pos)
                pos += len(tok)
            logprobs = CompletionLogprobs(
                tokens=tokens, token_logprobs=list(c.logprobs),
                top_logprobs=[{tok: lp} for tok, lp in zip(tokens, c.logprobs, strict=True)], text_offset=offsets,
            )
        choices.append(CompletionChoice(index=i, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                                        token_ids=list(c.token_ids)))
    return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                              choices=choices, usage=_usage(outs, n))


def chat_response(
    outs: Sequence[Completion], model: str, n: int, want_logprobs: bool, decode: Callable[[int], str]
) -> ChatCompletionResponse:
    choices = []
    for i, c in enumerate(outs):
        logprobs = None
        if want_logprobs and c.logprobs is not None:
            content = []
            for t, lp in zip(c.token_ids, c.logprobs, strict=True):
                tok = decode(t)
                content.append(ChatTokenLogprob(token=tok, logprob=lp, bytes=list(tok.encode("utf-8"))))
            logprobs = ChatChoiceLogprobs(content=content)
        choices.append(ChatChoice(index=i, message=AssistantMessage(content=c.text), logprobs=logprobs,
                                  finish_reason=c.finish_reason))
    return ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                  choices=choices, usage=_usage(outs, n))
