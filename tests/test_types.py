"""Validation at the edges: bad values fail with an error that names the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams, types


def _fields(exc: ValidationError) -> set[str]:
    return {".".join(str(p) for p in err["loc"]) for err in exc.errors()}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert field in _fields(info.value)


def test_top_k_zero_disables_top_k_as_vllm_reads_it() -> None:
    assert SamplingParams(top_k=0).top_k == -1


def test_sampling_params_accept_single_stop_string() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_unknown_sampling_field_is_rejected() -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(max_new_tokens=5)
    assert "max_new_tokens" in _fields(info.value)


def test_request_needs_exactly_one_input() -> None:
    with pytest.raises(ValidationError, match="exactly one of prompt_token_ids, prompts or messages; got prompt_token_ids, prompts"):
        GenerateRequest(prompts=["a"], prompt_token_ids=[[1]])
    with pytest.raises(ValidationError, match="got none"):
        GenerateRequest()


def test_request_rejects_empty_batch_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="prompts: empty batch"):
        GenerateRequest(prompts=[])
    with pytest.raises(ValidationError, match="prompt_token_ids: empty batch"):
        GenerateRequest(prompt_token_ids=[])


def test_request_rejects_empty_and_negative_token_prompts() -> None:
    with pytest.raises(ValidationError) as info:
        GenerateRequest(prompt_token_ids=[[1, 2], []])
    assert "prompt_token_ids" in _fields(info.value)
    with pytest.raises(ValidationError, match="token ids must be >= 0"):
        GenerateRequest(prompt_token_ids=[[1, -2]])


def test_chat_messages_validated() -> None:
    req = GenerateRequest(messages=[[{"role": "user", "content": "hi"}]])
    assert req.batch_size == 1 and req.messages is not None
    with pytest.raises(ValidationError) as info:
        GenerateRequest(messages=[[{"role": "wizard", "content": "hi"}]])
    assert any(f.startswith("messages") for f in _fields(info.value))


def test_empty_conversation_and_infinite_temperature_are_rejected() -> None:
    with pytest.raises(ValidationError) as info:
        GenerateRequest(messages=[[]])
    assert any(f.startswith("messages") for f in _fields(info.value))
    with pytest.raises(ValidationError) as info:
        SamplingParams(temperature=float("inf"))
    assert "temperature" in _fields(info.value)


def test_engine_config_validation() -> None:
    with pytest.raises(ValidationError) as info:
        EngineConfig(model="m", tensor_parallel_size=0)
    assert "tensor_parallel_size" in _fields(info.value)
    with pytest.raises(ValidationError) as info:
        EngineConfig(model="m", dtype="float8")
    assert "dtype" in _fields(info.value)
    assert EngineConfig(model="m", options={"enforce_eager": True}).options == {"enforce_eager": True}


# ---- request limits: refused at the edge, naming the limit ----------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"top_k": 2**64}, "top_k", "MAX_TOP_K"),
        ({"top_k": 2**31}, "top_k", "MAX_TOP_K"),
        ({"max_tokens": 2**20 + 1}, "max_tokens", "MAX_TOKENS"),
        ({"n": 1025}, "n", "MAX_N"),
        ({"logprobs": 21}, "logprobs", "MAX_LOGPROBS"),
        ({"seed": 2**63}, "seed", "signed 64-bit"),
        ({"seed": -(2**63) - 1}, "seed", "signed 64-bit"),
        ({"stop": [f"s{i}" for i in range(129)]}, "stop", "MAX_STOP_STRINGS"),
        ({"stop": ["x" * 1025]}, "stop", "MAX_STOP_STRING_CHARS"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "MAX_STOP_TOKEN_IDS"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids", "MAX_TOKEN_ID"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
    ],
)
def test_sampling_limits(kwargs: dict, field: str, limit: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert field in _fields(info.value)
    assert limit in str(info.value)


def test_sampling_limits_accept_their_bounds() -> None:
    s = SamplingParams(top_k=types.MAX_TOP_K, max_tokens=types.MAX_TOKENS, n=types.MAX_N, logprobs=types.MAX_LOGPROBS,
                       seed=types.MAX_SEED, stop=[f"s{i}" for i in range(types.MAX_STOP_STRINGS)],
                       stop_token_ids=[types.MAX_TOKEN_ID] * types.MAX_STOP_TOKEN_IDS)
    assert s.top_k == 2**31 - 1 and s.seed == 2**63 - 1
    assert SamplingParams(seed=types.MIN_SEED, stop=["x" * types.MAX_STOP_STRING_CHARS]).seed == -(2**63)


def test_a_huge_stop_list_is_refused_before_its_items_are_checked() -> None:
    with pytest.raises(ValidationError, match="100000 stop strings is more than MAX_STOP_STRINGS") as info:
        SamplingParams(stop=[""] * 100_000)  # each item is invalid too: the count is reported alone
    assert len(info.value.errors()) == 1


def test_prompt_limits() -> None:
    with pytest.raises(ValidationError, match="MAX_PROMPT_CHARS") as info:
        GenerateRequest(prompts=["ok", "x" * (16 * 2**20)])
    assert "prompts" in _fields(info.value) and "prompt 1 has 16777216 characters" in str(info.value)
    assert GenerateRequest(prompts=["x" * types.MAX_PROMPT_CHARS]).batch_size == 1
    with pytest.raises(ValidationError, match="MAX_TOKEN_ID") as info:
        GenerateRequest(prompt_token_ids=[[1, 2**31]])
    assert "prompt_token_ids" in _fields(info.value)
    with pytest.raises(ValidationError, match="MAX_PROMPT_TOKENS"):
        GenerateRequest(prompt_token_ids=[[1] * (types.MAX_PROMPT_TOKENS + 1)])


def test_chat_limits() -> None:
    with pytest.raises(ValidationError, match="MAX_PROMPT_CHARS") as info:
        GenerateRequest(messages=[[{"role": "user", "content": "x" * (types.MAX_PROMPT_CHARS + 1)}]])
    assert any(f.startswith("messages") for f in _fields(info.value))
    half = "x" * (types.MAX_PROMPT_CHARS // 2 + 1)  # each message fits; the conversation does not
    with pytest.raises(ValidationError, match="conversation 0 has .* characters of content"):
        GenerateRequest(messages=[[{"role": "user", "content": half}, {"role": "assistant", "content": half}]])
    with pytest.raises(ValidationError, match="MAX_CHAT_MESSAGES"):
        GenerateRequest(messages=[[{"role": "user", "content": "hi"}] * (types.MAX_CHAT_MESSAGES + 1)])


def test_sequences_per_request_are_bounded() -> None:
    with pytest.raises(ValidationError, match=r"2049 x 2 = 4098 sequences, more than MAX_SEQUENCES \(4096\)"):
        GenerateRequest(prompt_token_ids=[[1]] * 2049, sampling=SamplingParams(n=2))
    with pytest.raises(ValidationError, match="4097 prompts is more than MAX_SEQUENCES") as info:
        GenerateRequest(prompts=["a"] * 4097)
    assert "prompts" in _fields(info.value)
    assert GenerateRequest(prompt_token_ids=[[1]] * 2048, sampling=SamplingParams(n=2)).batch_size == 2048
