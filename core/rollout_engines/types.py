"""Data that crosses the library's edges: configs, requests and outputs (pydantic v2).

Everything a caller hands in or gets back is validated here, so a backend can trust what it
receives and a mistake is reported with the field that caused it.

Request limits
--------------
Every value a request carries is bounded here, so that no single request can overflow a backend's
integer types or stall an engine (and the requests batched with it) before a length check runs.
The limits are module constants, read when a request is validated:

- ``MAX_TOKEN_ID`` = 2**31-1: the largest token id (prompts, ``stop_token_ids``);
- ``MAX_TOP_K`` = 2**31-1: the largest ``top_k``; engines clamp a ``top_k`` above the vocabulary
  to the vocabulary (as vLLM does);
- ``MAX_TOKENS`` = 2**20: the largest ``max_tokens``;
- ``MAX_N`` = 1024: the largest ``n`` (samples per prompt);
- ``MAX_SEQUENCES`` = 4096: the largest batch size x ``n`` of one request;
- ``MAX_LOGPROBS`` = 20: the largest ``logprobs``;
- ``MIN_SEED`` = -2**63, ``MAX_SEED`` = 2**63-1: ``seed`` fits a signed 64-bit integer;
- ``MAX_STOP_STRINGS`` = 128 stop strings, each of at most ``MAX_STOP_STRING_CHARS`` = 1024
  characters; ``MAX_STOP_TOKEN_IDS`` = 1024 stop token ids;
- ``MAX_PROMPT_CHARS`` = 2**22 (about 4 M): characters of one text prompt, or of one chat's
  message contents together, checked before anything is tokenized;
- ``MAX_PROMPT_TOKENS`` = 2**20: tokens of one ``prompt_token_ids`` prompt;
- ``MAX_CHAT_MESSAGES`` = 4096: messages in one conversation;
- ``MAX_LORA_RANK`` = 1024: the largest LoRA rank; adapter names match ``LORA_NAME_PATTERN``.

A request past a limit fails validation (pydantic's ``ValidationError``; the HTTP server answers
422) with a message that names the limit and what to do instead.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
FinishReason = Literal["stop", "length", "abort"]
#: ``abort``: in-flight requests end now with what they have; ``wait``: they finish, no new ones
#: start; ``keep``: they freeze where they are and continue after ``resume()`` (with the weights
#: current then).
PauseMode = Literal["abort", "wait", "keep"]
MAX_REQUEST_ID_CHARS = 256

MAX_TOKEN_ID = 2**31 - 1
MAX_TOP_K = 2**31 - 1
MAX_TOKENS = 2**20
MAX_N = 1024
MAX_SEQUENCES = 4096
MAX_LOGPROBS = 20
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPT_CHARS = 2**22
MAX_PROMPT_TOKENS = 2**20
MAX_CHAT_MESSAGES = 4096
MAX_LORA_RANK = 1024
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def _check_token_ids(ids: list[int], what: str) -> None:
    for t in ids:
        if t < 0:
            raise ValueError(f"{what}: token ids must be >= 0, got {t}")
        if t > MAX_TOKEN_ID:
            raise ValueError(
                f"{what}: token id {t} is above MAX_TOKEN_ID ({MAX_TOKEN_ID}, 2**31-1); "
                "token ids must come from the model's vocabulary"
            )


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
    top_k: int = Field(
        default=-1, ge=-1,
        description=f"-1 (or 0, as vLLM reads it) disables top-k; at most MAX_TOP_K ({MAX_TOP_K}); above the "
        "vocabulary it is the vocabulary.",
    )
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(default=16, ge=1, description=f"At most MAX_TOKENS ({MAX_TOKENS}).")
    stop: list[str] = Field(
        default_factory=list,
        description=f"At most MAX_STOP_STRINGS ({MAX_STOP_STRINGS}) of at most {MAX_STOP_STRING_CHARS} characters.",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list, description=f"At most MAX_STOP_TOKEN_IDS ({MAX_STOP_TOKEN_IDS}) ids."
    )
    ignore_eos: bool = False
    seed: int | None = Field(default=None, description="A signed 64-bit integer.")
    logprobs: int | None = Field(
        default=None, ge=0, description=f"Return the sampled token's logprob; at most MAX_LOGPROBS ({MAX_LOGPROBS})."
    )
    n: int = Field(default=1, ge=1, description=f"Samples per prompt; at most MAX_N ({MAX_N}).")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS,
        description="Per generated position, the k most likely tokens with their logprobs (sorted, "
        "plus the sampled token when it is not among them). Needs capability 'top_logprobs' >= k.",
    )
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS,
        description="Per prompt token, its logprob given the tokens before it (the first has none); "
        "k > 0 adds the k most likely tokens per position. Needs capability 'prompt_logprobs'.",
    )

    @field_validator("top_k")
    @classmethod
    def _top_k_valid(cls, v: int) -> int:
        if v == 0:
            return -1  # disabled, as vLLM and transformers read 0
        if v > MAX_TOP_K:
            raise ValueError(
                f"top_k={v} is above MAX_TOP_K ({MAX_TOP_K}, 2**31-1); use -1 to disable top-k "
                "(a top_k above the vocabulary size means the whole vocabulary)"
            )
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_bounded(cls, v: int) -> int:
        if v > MAX_TOKENS:
            raise ValueError(
                f"max_tokens={v} is above MAX_TOKENS ({MAX_TOKENS}); ask for at most that many "
                "(the engine's context window caps generation anyway)"
            )
        return v

    @field_validator("n")
    @classmethod
    def _n_bounded(cls, v: int) -> int:
        if v > MAX_N:
            raise ValueError(f"n={v} is above MAX_N ({MAX_N}); split the samples over several requests")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs_bounded(cls, v: int | None) -> int | None:
        if v is not None and v > MAX_LOGPROBS:
            raise ValueError(f"logprobs={v} is above MAX_LOGPROBS ({MAX_LOGPROBS}); ask for at most {MAX_LOGPROBS}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed_in_64_bits(cls, v: int | None) -> int | None:
        if v is not None and not MIN_SEED <= v <= MAX_SEED:
            raise ValueError(
                f"seed={v} does not fit a signed 64-bit integer [MIN_SEED, MAX_SEED] = [-2**63, 2**63-1]; "
                "reduce it, e.g. seed % 2**63"
            )
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str) else v
        # Checked before the items are validated: a huge list is refused without walking it.
        if isinstance(v, list | tuple) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(
                f"{len(v)} stop strings is more than MAX_STOP_STRINGS ({MAX_STOP_STRINGS}); "
                "pass fewer (cut the text afterwards for the rest)"
            )
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings_valid(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        long = next((s for s in v if len(s) > MAX_STOP_STRING_CHARS), None)
        if long is not None:
            raise ValueError(
                f"a stop string of {len(long)} characters is longer than MAX_STOP_STRING_CHARS "
                f"({MAX_STOP_STRING_CHARS}); use a shorter one"
            )
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids_count(cls, v: Any) -> Any:
        if isinstance(v, list | tuple) and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"{len(v)} stop token ids is more than MAX_STOP_TOKEN_IDS ({MAX_STOP_TOKEN_IDS}); pass fewer"
            )
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids_valid(cls, v: list[int]) -> list[int]:
        _check_token_ids(v, "stop_token_ids")
        return v


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(description=f"At most MAX_PROMPT_CHARS ({MAX_PROMPT_CHARS}) characters per chat.")

    @field_validator("content")
    @classmethod
    def _content_bounded(cls, v: str) -> str:
        if len(v) > MAX_PROMPT_CHARS:
            raise ValueError(
                f"message content of {len(v)} characters is longer than MAX_PROMPT_CHARS ({MAX_PROMPT_CHARS}); "
                "shorten it"
            )
        return v


class LoraSpec(_Model):
    """A LoRA adapter as PEFT's ``adapter_config.json`` describes it (what a LoRA push carries).

    Its tensors are named as PEFT saves them: ``base_model.model.<module>.lora_A.weight``
    (``[rank, in_features]``) and ``...lora_B.weight`` (``[out_features, rank]``) for every module of
    the base model whose name ends in one of ``target_modules`` (``"q_proj"``, ``"v_proj"``).
    The update is ``W x + (alpha / rank) * B A x``.
    """

    name: str = Field(pattern=LORA_NAME_PATTERN, description="What requests name in GenerateRequest.lora.")
    rank: int = Field(ge=1, le=MAX_LORA_RANK)
    alpha: float = Field(gt=0.0, allow_inf_nan=False)
    target_modules: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(min_length=1, max_length=256)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class GenerateRequest(_Model):
    """A batch: exactly one of ``prompt_token_ids``, ``prompts`` or ``messages`` (one chat per entry)."""

    prompt_token_ids: list[list[int]] | None = None
    prompts: list[str] | None = None
    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    session_id: str | None = Field(default=None, description="Routes a multi-turn session to one engine.")
    request_ids: list[str] | None = Field(
        default=None,
        description="One id per prompt x sample (prompt-major), unique among the engine's running "
        "requests; assigned when absent. Abort takes these ids.",
    )
    lora: str | None = Field(
        default=None, pattern=LORA_NAME_PATTERN,
        description="Name of a loaded LoRA adapter every prompt of the request uses; None: the base model.",
    )
    continue_from: list[Completion] | None = Field(
        default=None,
        description="Partial rollouts: one earlier completion per prompt (n must be 1). The engine "
        "prefills prompt + its tokens under the current weights and appends; the result carries the "
        "whole response (earlier tokens, logprobs and per-token versions first).",
    )

    @field_validator("request_ids")
    @classmethod
    def _ids_bounded(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if len(set(v)) != len(v):
                raise ValueError("request_ids must be unique")
            bad = next((r for r in v if not r or len(r) > MAX_REQUEST_ID_CHARS), None)
            if bad is not None:
                raise ValueError(f"request ids must be 1..{MAX_REQUEST_ID_CHARS} characters, got {bad[:40]!r}")
        return v

    @field_validator("prompt_token_ids", "prompts", "messages", mode="before")
    @classmethod
    def _batch_bounded(cls, v: Any) -> Any:
        # Checked before the items are validated: a huge batch is refused without walking it.
        if isinstance(v, list | tuple) and len(v) > MAX_SEQUENCES:
            raise ValueError(
                f"{len(v)} prompts is more than MAX_SEQUENCES ({MAX_SEQUENCES}) sequences per request; "
                "split the batch over several requests"
            )
        return v

    @field_validator("prompt_token_ids")
    @classmethod
    def _ids_valid(cls, v: list[list[int]] | None) -> list[list[int]] | None:
        if v is not None:
            for i, p in enumerate(v):
                if len(p) == 0:
                    raise ValueError("every prompt needs at least one token")
                if len(p) > MAX_PROMPT_TOKENS:
                    raise ValueError(
                        f"prompt {i} has {len(p)} tokens, more than MAX_PROMPT_TOKENS ({MAX_PROMPT_TOKENS}); "
                        "shorten it"
                    )
                _check_token_ids(p, f"prompt {i}")
        return v

    @field_validator("prompts")
    @classmethod
    def _prompts_bounded(cls, v: list[str] | None) -> list[str] | None:
        for i, p in enumerate(v or ()):
            if len(p) > MAX_PROMPT_CHARS:
                raise ValueError(
                    f"prompt {i} has {len(p)} characters, more than MAX_PROMPT_CHARS ({MAX_PROMPT_CHARS}); "
                    "shorten it (it is refused before tokenizing)"
                )
        return v

    @field_validator("messages")
    @classmethod
    def _chats_bounded(cls, v: list[list[ChatMessage]] | None) -> list[list[ChatMessage]] | None:
        for i, chat in enumerate(v or ()):
            if len(chat) > MAX_CHAT_MESSAGES:
                raise ValueError(
                    f"conversation {i} has {len(chat)} messages, more than MAX_CHAT_MESSAGES "
                    f"({MAX_CHAT_MESSAGES}); shorten it"
                )
            chars = sum(len(m.content) for m in chat)
            if chars > MAX_PROMPT_CHARS:
                raise ValueError(
                    f"conversation {i} has {chars} characters of content, more than MAX_PROMPT_CHARS "
                    f"({MAX_PROMPT_CHARS}); shorten it (it is refused before the chat template runs)"
                )
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
        sequences = self.batch_size * self.sampling.n
        if sequences > MAX_SEQUENCES:
            raise ValueError(
                f"batch size x n = {self.batch_size} x {self.sampling.n} = {sequences} sequences, more than "
                f"MAX_SEQUENCES ({MAX_SEQUENCES}) per request; split the batch over several requests"
            )
        if self.request_ids is not None and len(self.request_ids) != sequences:
            raise ValueError(
                f"request_ids has {len(self.request_ids)} ids; give one per prompt x sample ({sequences})"
            )
        if self.continue_from is not None:
            if len(self.continue_from) != self.batch_size:
                raise ValueError(
                    f"continue_from has {len(self.continue_from)} completions; give one per prompt ({self.batch_size})"
                )
            if self.sampling.n != 1:
                raise ValueError("continue_from continues one sample per prompt: use n=1")
        return self

    def sequence_ids(self) -> list[str]:
        """The request id of every prompt x sample (prompt-major): the caller's, else new ones."""
        if self.request_ids is not None:
            return list(self.request_ids)
        return [uuid.uuid4().hex for _ in range(self.batch_size * self.sampling.n)]

    @property
    def batch_size(self) -> int:
        for key in ("prompt_token_ids", "prompts", "messages"):
            value = getattr(self, key)
            if value is not None:
                return len(value)
        return 0


class _Output(_Model):
    """An engine's output. Its logprobs may be ``-inf`` (a token an engine's processed logprobs
    masked): as JSON text it keeps ``-Infinity`` (Python's ``json`` and pydantic read it back), not
    ``null``, which no float field accepts (a served engine's output would not parse)."""

    model_config = ConfigDict(extra="forbid", frozen=False, ser_json_inf_nan="constants")


class TokenLogprob(_Output):
    token_id: int
    logprob: float


class Completion(_Output):
    """One sampled continuation. A request of B prompts with ``n`` samples gives B*n of these,
    ordered prompt-major (all samples of prompt 0 first)."""

    prompt_index: int
    sample_index: int = 0
    request_id: str = ""
    prompt_token_ids: list[int] = Field(default_factory=list)
    token_ids: list[int]
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[TokenLogprob]] | None = None
    finish_reason: FinishReason
    weight_version: int = Field(description="The version of the weights that produced the last token.")
    token_weight_versions: list[int] | None = Field(
        default=None,
        description="One weight version per output token, when the completion spans more than one "
        "version (a rollout paused and continued across a push); None when all are weight_version.",
    )
    lora: str | None = Field(default=None, description="The LoRA adapter that produced it (None: base model).")
    lora_version: int | None = Field(default=None, description="That adapter's version (its push's version).")

    def versions(self) -> list[int]:
        """The weight version of every output token."""
        if self.token_weight_versions is not None:
            return list(self.token_weight_versions)
        return [self.weight_version] * len(self.token_ids)


class StreamDelta(_Output):
    """What ``Engine.stream`` yields: new tokens of one prompt x sample since its last delta."""

    request_id: str
    prompt_index: int
    sample_index: int = 0
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[TokenLogprob]] | None = None
    weight_version: int
    finish_reason: FinishReason | None = Field(default=None, description="Set on the last delta of a sequence.")
    lora: str | None = Field(default=None, description="The LoRA adapter generating these tokens (GenerateRequest.lora).")
    lora_version: int | None = Field(default=None, description="That adapter's version.")


class EngineInfo(_Model):
    backend: str
    model: str
    weight_version: int
    asleep: list[str] = Field(default_factory=list, description="Tags currently released.")
    paused: bool = False
    paused_s: float | None = Field(default=None, description="Seconds spent paused since start, the "
                                   "current pause included (None where the engine does not count them).")
    held_s: float | None = Field(default=None, description="Seconds generation was held since start: paused, "
                                 "or applying a weight update on a backend whose updates stop generation "
                                 "(vLLM, SGLang); overlaps count once (None where not counted).")
    outstanding: int = 0
    healthy: bool = Field(default=True, description="Ready: generation is accepted now (not closed, weights "
                          "valid, no update stuck). Liveness is Engine.health().")
    capabilities: dict[str, Any] = Field(default_factory=dict)
    loras: dict[str, int] = Field(default_factory=dict, description="Loaded LoRA adapters: name -> version.")
    extra: dict[str, Any] = Field(default_factory=dict)


class ReceiveTimings(_Model):
    """One receiver's account of one weight update, in seconds (zero where a phase did not occur)."""

    validate_s: float = Field(default=0.0, description="Checking the manifest against the model.")
    wait_s: float = Field(default=0.0, description="Waiting for buckets from the trainer.")
    wait_first_s: float = Field(default=0.0, description="Of wait_s, waiting for the first bucket (the trainer "
                                "starting late, against keeping up with the copies after that).")
    check_s: float = Field(default=0.0, description="Checksums of the buckets.")
    apply_s: float = Field(default=0.0, description="Copies into the model.")
    install_s: float = Field(default=0.0, description="Registering a received LoRA adapter with the engine.")
    install_cpu_s: float = Field(default=0.0, description="Of install_s, the installing thread's CPU time (the "
                                 "rest it waited: for Python's GIL, a lock, the device).")
    total_s: float = 0.0
    gpu_s: float = Field(default=0.0, description="On the GPU, from the first copy's start to the last one's end "
                         "(CUDA receivers with ROLLOUT_ENGINES_PUSH_TIMELINE=1; zero otherwise).")
    gpu_busy_s: float = Field(default=0.0, description="On the GPU, the sum of each bucket's copies (same condition).")

    @classmethod
    def of(cls, timings: dict[str, float] | None) -> ReceiveTimings:
        """From a :class:`~rollout_engines.weights.receiver.WeightReceiver`'s ``last_timings``
        (``{"validate": s, "wait": s, ...}``); phases it does not name stay zero."""
        return cls(**{f"{k}_s": float(v) for k, v in (timings or {}).items() if f"{k}_s" in cls.model_fields})

    def phases(self) -> dict[str, float]:
        """``{"validate": s, "wait": s, "check": s, "apply": s, "total": s}``."""
        return {name.removesuffix("_s"): value for name, value in self.model_dump().items()}


class LastReceive(_Model):
    """Where the last weight update's time went."""

    version: int = Field(description="The version the update carried.")
    rpc_s: float | None = Field(
        default=None, description="The round trip into the engine's worker processes as the engine saw it "
        "(None: received in the engine's own process).")
    direct: bool = Field(
        default=False, description="The workers were handed the update through the weight-sync store's "
        "doorbell (rollout_engines.weights.doorbell), not the engine's RPC; rpc_s is that round trip.")
    workers: list[ReceiveTimings] = Field(
        default_factory=list, description="Each worker's own account (one entry where one receiver took it).")


class Diagnostics(_Model):
    """What an engine measured lately and knows about its weights, for benchmarks and tests
    (:meth:`~rollout_engines.engine.EngineProtocol.diagnostics`). ``None``: not known here."""

    backend: str
    weight_version: int
    platform: str | None = Field(default=None, description="'cuda' or 'cpu' (where the weights live).")
    weights_dtype: str | None = Field(default=None, description="The dtype pushes must carry ('bfloat16').")
    last_receive: LastReceive | None = Field(default=None, description="None: no update received yet.")
    last_reset_s: float | None = Field(
        default=None, description="Seconds of the last prefix-cache reset (0.0: skipped, nothing was cached).")
    weights_fingerprint: Any = Field(
        default=None, description="With diagnostics(fingerprint=True), on engines that can tell weight states "
        "apart without generating (a JSON value: equal states, equal fingerprints); else None.")


GenerateRequest.model_rebuild()
