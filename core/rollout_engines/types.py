"""Data that crosses the library's edges: configs, requests and outputs (pydantic v2).

Everything a caller hands in or gets back is validated here, so a backend can trust what it
receives and a mistake is reported with the field that caused it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
FinishReason = Literal["stop", "length", "abort"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class EngineConfig(_Model):
    """How to start one engine. Backend-specific settings go in ``options`` untouched."""

    backend: str = "transformers"
    model: str = Field(..., min_length=1, description="Local path (or hub id where allowed) of the model.")
    tokenizer: str | None = None
    dtype: Dtype = "auto"
    seed: int = 0
    max_model_len: int | None = Field(default=None, gt=0)
    tensor_parallel_size: int = Field(default=1, ge=1)
    device: str | None = Field(default=None, description="'cpu', 'cuda', 'cuda:1'; None picks one.")
    options: dict[str, Any] = Field(default_factory=dict, description="Passed through to the backend.")


class SamplingParams(_Model):
    """Sampling controls, shared by every backend (vLLM's names and meanings)."""

    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1 disables top-k.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(default=16, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, description="Return the sampled token's logprob.")
    n: int = Field(default=1, ge=1)

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class GenerateRequest(_Model):
    """A batch: exactly one of ``prompt_token_ids``, ``prompts`` or ``messages`` (one chat per entry)."""

    prompt_token_ids: list[list[int]] | None = None
    prompts: list[str] | None = None
    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    session_id: str | None = Field(default=None, description="Routes a multi-turn session to one engine.")

    @field_validator("prompt_token_ids")
    @classmethod
    def _ids_valid(cls, v: list[list[int]] | None) -> list[list[int]] | None:
        if v is not None:
            if any(len(p) == 0 for p in v):
                raise ValueError("every prompt needs at least one token")
            if any(t < 0 for p in v for t in p):
                raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _exactly_one_input(self) -> GenerateRequest:
        given = [k for k in ("prompt_token_ids", "prompts", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of prompt_token_ids, prompts or messages; got "
                + (", ".join(given) if given else "none")
            )
        if len(getattr(self, given[0])) == 0:
            raise ValueError(f"{given[0]}: empty batch; pass at least one prompt")
        return self

    @property
    def batch_size(self) -> int:
        for key in ("prompt_token_ids", "prompts", "messages"):
            value = getattr(self, key)
            if value is not None:
                return len(value)
        return 0


class Completion(_Model):
    """One sampled continuation. A request of B prompts with ``n`` samples gives B*n of these,
    ordered prompt-major (all samples of prompt 0 first)."""

    prompt_index: int
    sample_index: int = 0
    prompt_token_ids: list[int] = Field(default_factory=list)
    token_ids: list[int]
    text: str = ""
    logprobs: list[float] | None = None
    finish_reason: FinishReason
    weight_version: int


class EngineInfo(_Model):
    backend: str
    model: str
    weight_version: int
    asleep: list[str] = Field(default_factory=list, description="Tags currently released.")
    paused: bool = False
    outstanding: int = 0
    healthy: bool = True
    capabilities: dict[str, Any] = Field(default_factory=dict)
    extra: dict[str, Any] = Field(default_factory=dict)
