"""The server's routes at their edges, each against a real server on 127.0.0.1:

- ``/weights/init`` with a store transport whose ``options`` lack or garble ``host``/``port`` is a
  422 naming the field (it was a 500, ``KeyError: 'port'``);
- a logprob of ``-inf`` (the engine's, e.g. vLLM's processed logprobs of masked tokens) reached
  OpenAI clients as ``null``, which no OpenAI / vLLM client expects: vLLM sends ``-9999.0``
  (``max(logprob, -9999.0)`` in its serving code), and lm-eval sums these values, TRL sorts them;
- an OpenAI chat message whose ``content`` is a list of text parts (the OpenAI API's other form,
  which vLLM accepts) was refused with 422.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_engines.types import Completion, EngineConfig, GenerateRequest, TokenLogprob

from .conftest import ThreadServer, start_thread_server
from .test_async_routes import ScriptedEngine, sse_events

pytestmark = pytest.mark.remote


def post(server: ThreadServer, path: str, body: Any, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=timeout)


# ---- /weights/init: malformed store options are a 422, not a 500 ---------------------------------------
@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"host": "127.0.0.1"}, "options.port"),
        ({"port": 29500}, "options.host"),
        ({"host": "127.0.0.1", "port": "twelve"}, "options.port"),
        ({"host": "127.0.0.1", "port": [1]}, "options.port"),
        ({"host": "127.0.0.1", "port": 70_000}, "options.port"),
        ({"host": 12, "port": 29500}, "options.host"),
    ],
)
def test_weights_init_with_malformed_store_options_is_422(thread_server, options, param):
    spec = {"transport": "gloo", "session_id": "s", "timeout_s": 5, "options": options}
    r = post(thread_server, "/weights/init", spec)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "ValidationError" and error["param"] == param, error
    # The server is not left half-initialised: generation still works.
    r = post(thread_server, "/generate", {"prompt_token_ids": [[1, 2]], "sampling": {"max_tokens": 2}})
    assert r.status_code == 200, r.text


# ---- -inf logprobs reach OpenAI clients as vLLM's -9999.0 ------------------------------------------------
class MaskedLogprobEngine(ScriptedEngine):
    """The scripted engine, with a ``-inf`` where an engine reports a masked token: each sequence's
    first generated token's logprob and top entries, and the second prompt position."""

    capabilities = ScriptedEngine.capabilities.model_copy(update={"chat": True})

    def _prompt(self, request: GenerateRequest, i: int) -> list[int]:
        if request.messages is not None:
            return [3, 4, 5]
        return super()._prompt(request, i)

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        outs = await super()._generate(request)
        for c in outs:
            if c.logprobs:
                c.logprobs[0] = -math.inf
            if request.sampling.top_logprobs and c.logprobs:
                c.top_logprobs = [[TokenLogprob(token_id=t, logprob=lp)]
                                  for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
                c.top_logprobs[0] = [TokenLogprob(token_id=c.token_ids[0], logprob=-math.inf),
                                     TokenLogprob(token_id=9, logprob=-math.inf)]
            if c.prompt_logprobs and len(c.prompt_logprobs) > 1:
                c.prompt_logprobs[1] = -math.inf
                if c.prompt_top_logprobs:
                    c.prompt_top_logprobs[1] = [TokenLogprob(token_id=9, logprob=-math.inf)]
        return outs

    async def _stream(self, request: GenerateRequest) -> Any:
        seen: set[str] = set()
        async for d in super()._stream(request):
            if d.logprobs and d.request_id not in seen:  # each sequence's first token
                d = d.model_copy(update={"logprobs": [-math.inf, *d.logprobs[1:]]})
            seen.add(d.request_id)
            yield d


@pytest.fixture(scope="module")
def masked(tiny_model: Path) -> Iterator[ThreadServer]:
    engine = MaskedLogprobEngine(EngineConfig(backend="scripted", model=str(tiny_model)), step_s=0.001)
    server = start_thread_server(engine)
    yield server
    server.stop()


def numbers(value: Any) -> list[Any]:
    """Every number (and null) in a logprobs structure, the first echoed position's None aside."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    return [value] if value is None or isinstance(value, float) else []


def test_minus_inf_logprobs_are_minus_9999_in_completions(masked):
    r = post(masked, "/v1/completions", {"prompt": [[5, 6, 7]], "max_tokens": 2, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-9999.0, -0.5], lp
    assert None not in numbers(lp["top_logprobs"]) and -9999.0 in numbers(lp["top_logprobs"][0])
    # lm-eval's log-likelihood request: echo + logprobs, max_tokens 1; it sums token_logprobs[ctxlen:-1].
    r = post(masked, "/v1/completions", {"prompt": [[5, 6, 7]], "max_tokens": 1, "logprobs": 1, "echo": True,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert None not in lp["token_logprobs"][1:] and lp["token_logprobs"][1] == -9999.0, lp
    assert sum(lp["token_logprobs"][1:-1]) == -9999.0 + -1.0
    assert None not in numbers(lp["top_logprobs"][1:])
    # vLLM's prompt_logprobs extra (TRL's get_sequence_logprobs): the same clamp.
    r = post(masked, "/v1/completions", {"prompt": [[5, 6, 7]], "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    prompt_lps = r.json()["choices"][0]["prompt_logprobs"]
    assert prompt_lps[0] is None
    assert all(e["logprob"] == -9999.0 for e in prompt_lps[1].values()), prompt_lps


def test_minus_inf_logprobs_are_minus_9999_in_chat(masked):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 2}
    r = post(masked, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content[0]["logprob"] == -9999.0 and content[1]["logprob"] == -0.5, content
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-9999.0, -9999.0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_minus_inf_logprobs_are_minus_9999_in_streams(masked, path):
    body: dict[str, Any] = {"max_tokens": 3, "stream": True, "logprobs": True if "chat" in path else 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": [[5, 6]]})
    r = post(masked, path, body)
    assert r.status_code == 200, r.text
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    values = []
    for e in events[:-1]:
        for choice in e["choices"]:
            lp = choice.get("logprobs")
            if lp is None:
                continue
            values += [t["logprob"] for t in lp["content"]] if "content" in lp else lp["token_logprobs"]
    assert values == [-9999.0, -0.5, -0.5], json.dumps(events)[:2000]


# ---- chat content as a list of text parts ---------------------------------------------------------------
def test_chat_content_parts_are_served_as_their_text(thread_server):
    """vLLM joins a message's text parts with newlines (``"\\n".join(texts)`` in its chat_utils)."""
    plain = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello\nthere"}],
             "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    parts = {**plain, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
    ]}
    for stream in (False, True):
        a = post(thread_server, "/v1/chat/completions", {**plain, "stream": stream})
        b = post(thread_server, "/v1/chat/completions", {**parts, "stream": stream})
        assert a.status_code == 200 and b.status_code == 200, b.text
        if not stream:
            assert b.json()["prompt_token_ids"] == a.json()["prompt_token_ids"]
            assert b.json()["choices"][0]["message"] == a.json()["choices"][0]["message"]
        else:
            assert sse_events(b)[-1] == "[DONE]"
    # A part this server cannot serve (an image), or a malformed one, is a 422 naming it, not a 500.
    for part in ({"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text"}, "text"):
        bad = {**plain, "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, part]}]}
        r = post(thread_server, "/v1/chat/completions", bad)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["type"] == "ValidationError" and error["param"] == "messages", error
        assert "messages.0.content.1" in error["message"], error


async def test_minus_inf_logprobs_reach_the_remote_client_as_minus_inf(masked):
    """The native routes keep ``-inf`` as JSON's ``-Infinity`` (Python's json and pydantic read it),
    so an engine behind the server gives our client what it gives in-process (it was ``null``,
    which the client's float fields refused: the call failed)."""
    import rollout_engines as roe

    remote = roe.create_engine("remote", model=masked.url, api_key=masked.api_key)
    try:
        request = roe.GenerateRequest(prompt_token_ids=[[5, 6, 7]],
                                      sampling=roe.SamplingParams(max_tokens=2, logprobs=0, top_logprobs=2))
        [out] = await remote.generate(request)
        assert out.logprobs is not None and out.logprobs[0] == -math.inf
        assert out.top_logprobs is not None and out.top_logprobs[0][0].logprob == -math.inf
        deltas = [d async for d in remote.stream(request)]
        assert deltas[0].logprobs is not None and deltas[0].logprobs[0] == -math.inf
    finally:
        await remote.close()
