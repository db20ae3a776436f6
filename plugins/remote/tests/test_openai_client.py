"""The official ``openai`` client against the server (skipped where the client is not installed)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.remote

openai = pytest.importorskip("openai")


def test_openai_client_completions_and_chat(thread_server):
    client = openai.OpenAI(base_url=thread_server.url + "/v1", api_key=thread_server.api_key, max_retries=0)
    models = client.models.list()
    name = models.data[0].id
    done = client.completions.create(model=name, prompt="The quick brown fox", max_tokens=5, temperature=0,
                                     logprobs=1)
    choice = done.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.token_logprobs) == done.usage.completion_tokens > 0
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=thread_server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=name, prompt="x", max_tokens=0)
