"""Validation at the edges: bad values fail with an error that names the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams


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
        ({"top_k": 0}, "top_k"),
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
