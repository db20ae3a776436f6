"""The async-RL routes on real servers (uvicorn on 127.0.0.1): ``/generate/stream`` (SSE),
``/abort``, ``/pause`` with a mode, OpenAI streaming and echo + logprobs (lm-eval's
log-likelihood requests).

Two engines: the transformers engine (the tests that need a capability it does not declare yet
skip, saying which), and :class:`ScriptedEngine`, a small engine declaring every capability, whose
tokens come one at a time, so streaming, abort and pause modes are checked whatever the
transformers engine serves.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_engines.engine import Capabilities, Engine
from rollout_engines.types import (
    Completion,
    EngineConfig,
    GenerateRequest,
    PauseMode,
    StreamDelta,
    TokenLogprob,
)

from .conftest import ThreadServer, outstanding, start_thread_server, wait_until

pytestmark = pytest.mark.remote

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


# ---- a scripted engine: one token per step, every async-RL capability ----------------------------
class ScriptedEngine(Engine):
    """Token ``k`` of a sequence is ``40 + (last prompt token + k + sample) % 40``, one every
    ``step_s``; logprob ``-0.5``; prompt logprobs ``-1.0`` per position with two top entries."""

    backend_name = "scripted"
    capabilities = Capabilities(streaming=True, abort=True, pause_modes=("abort", "keep"), top_logprobs=5,
                                prompt_logprobs=True, logprobs=True, n=True, seed=True, pause=True)

    def __init__(self, config: EngineConfig, step_s: float = 0.02) -> None:
        super().__init__(config)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.step_s = step_s
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.closed_streams = 0

    def _prompt(self, request: GenerateRequest, i: int) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids[i])
        return [3 + (ord(ch) % 60) for ch in (request.prompts or [""])[i]][:32] or [3]

    async def _sequence(self, request: GenerateRequest, i: int, j: int, rid: str) -> AsyncGenerator[StreamDelta, None]:
        prompt, s = self._prompt(request, i), request.sampling
        self.running.add(rid)
        try:
            for k in range(s.max_tokens):
                await asyncio.sleep(self.step_s)
                while self._paused and self._pause_mode == "keep" and rid not in self.aborted:
                    await asyncio.sleep(0.01)
                if rid in self.aborted:
                    yield StreamDelta(request_id=rid, prompt_index=i, sample_index=j, weight_version=0,
                                      finish_reason="abort")
                    return
                last = k == s.max_tokens - 1
                token = 40 + (prompt[-1] + k + j) % 40
                yield StreamDelta(
                    request_id=rid, prompt_index=i, sample_index=j, token_ids=[token],
                    logprobs=[-0.5] if s.logprobs is not None else None,
                    top_logprobs=[[TokenLogprob(token_id=token, logprob=-0.5)]] if s.top_logprobs else None,
                    weight_version=self.weight_version, finish_reason="length" if last else None)
        finally:
            self.running.discard(rid)

    async def _stream(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        ids = request.request_ids or []
        n = request.sampling.n
        try:
            for i in range(request.batch_size):
                for j in range(n):
                    async for d in self._sequence(request, i, j, ids[i * n + j]):
                        yield d
        finally:
            self.closed_streams += 1

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        outs: dict[str, Completion] = {}
        s = request.sampling
        async for d in self._stream(request):
            prompt = self._prompt(request, d.prompt_index)
            c = outs.setdefault(d.request_id, Completion(
                prompt_index=d.prompt_index, sample_index=d.sample_index, request_id=d.request_id,
                prompt_token_ids=prompt, token_ids=[], logprobs=[] if s.logprobs is not None else None,
                finish_reason="length", weight_version=0))
            c.token_ids += d.token_ids
            if c.logprobs is not None:
                c.logprobs += d.logprobs or []
            if d.finish_reason:
                c.finish_reason = d.finish_reason
                c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            if s.prompt_logprobs is not None:
                c.prompt_logprobs = [None] + [-1.0] * (len(prompt) - 1)
                c.prompt_top_logprobs = [[]] + [[TokenLogprob(token_id=t, logprob=-1.0),
                                                 TokenLogprob(token_id=7, logprob=-2.0)][: max(1, s.prompt_logprobs)]
                                                for t in prompt[1:]]
        return list(outs.values())

    async def _abort(self, request_ids: Sequence[str] | None) -> None:
        self.aborted.update(self.running if request_ids is None else request_ids)

    async def _pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self.aborted.update(self.running)
        elif mode == "wait":
            while self.running:
                await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def scripted(tiny_model: Path) -> Iterator[ThreadServer]:
    engine = ScriptedEngine(EngineConfig(backend="scripted", model=str(tiny_model)))
    server = start_thread_server(engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scripted_vllm(tiny_model: Path) -> Iterator[ThreadServer]:
    """The scripted engine behind vLLM's RL routes (protocol ``vllm-rl``)."""
    engine = ScriptedEngine(EngineConfig(backend="scripted", model=str(tiny_model)))
    server = start_thread_server(engine, protocols=("vllm-rl",))
    yield server
    server.stop()


# ---- helpers -------------------------------------------------------------------------------------
def sse_data(text: str) -> Any:
    """The payload of an event's ``data:`` line (``"[DONE]"`` as the string); None for any other."""
    if not text.startswith("data: "):
        return None
    data = text[len("data: "):]
    return data if data == "[DONE]" else json.loads(data)


def sse_events(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of a complete event stream (``"[DONE]"`` as the string)."""
    return [d for d in map(sse_data, response.text.split("\n\n")) if d is not None]


def token_counts(server: ThreadServer) -> tuple[float, float]:
    """The server's ``rollout_prompt_tokens_total`` and ``rollout_generated_tokens_total``."""
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    values = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("rollout_prompt_tokens_total ", "rollout_generated_tokens_total "))}
    return values.get("rollout_prompt_tokens_total", 0.0), values.get("rollout_generated_tokens_total", 0.0)


def stream(server: ThreadServer, path: str, body: dict[str, Any], timeout: float = 120) -> list[Any]:
    r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=timeout)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def stream_in_thread(server: ThreadServer, path: str,
                     body: dict[str, Any]) -> tuple[threading.Thread, list[Any], threading.Event]:
    """Read an event stream from a thread as it comes: the thread, the events so far (``"[DONE]"``
    last) and an event set once a delta carried a token. A call meant to meet a running sequence
    waits for that event: a fixed sleep races the engine's speed (a quick machine finishes first)."""
    events: list[Any] = []
    token_seen = threading.Event()

    def consume() -> None:
        try:
            with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=120) as r:
                if r.status_code != 200:
                    raise AssertionError(f"{r.status_code}: {r.read()!r}")
                for data in map(sse_data, r.iter_lines()):
                    if data is not None:
                        events.append(data)
                        if data != "[DONE]" and data["token_ids"]:
                            token_seen.set()
        except Exception as exc:  # the test's checks of the events show it
            events.append(f"the stream failed: {exc!r}")
            token_seen.set()

    t = threading.Thread(target=consume)
    t.start()
    return t, events, token_seen


def caps(server: ThreadServer) -> dict[str, Any]:
    return httpx.get(server.url + "/info", headers=server.headers, timeout=30).json()["capabilities"]


def need(server: ThreadServer, flag: str) -> None:
    if not caps(server).get(flag):
        pytest.skip(f"the served engine does not declare capability '{flag}' (yet)")


def wait_in_flight(server: ThreadServer) -> None:
    """Until the server's engine counts a request outstanding: a fixed sleep after starting a request
    races a busy machine, where the request may reach the server after the call it is meant to meet."""
    wait_until(lambda: outstanding(server) >= 1, 30, "the request to reach the engine", every_s=0.01)


def reassemble(deltas: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    seqs: dict[tuple[int, int], dict[str, Any]] = {}
    for d in deltas:
        s = seqs.setdefault((d["prompt_index"], d["sample_index"]), {"token_ids": [], "finish_reason": None,
                                                                      "request_id": d["request_id"]})
        assert s["finish_reason"] is None, "a delta after the sequence's last one"
        s["token_ids"] += d["token_ids"]
        s["finish_reason"] = d["finish_reason"]
    return seqs


# ---- /generate/stream ----------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["transformers", "scripted"])
def test_stream_equals_generate_for_greedy(which, thread_server, scripted):
    server = thread_server if which == "transformers" else scripted
    body = {"prompt_token_ids": [[5, 6, 7], [8, 9]], "sampling": {**GREEDY, "n": 2}}
    before = token_counts(server)
    outs = httpx.post(server.url + "/generate", json=body, headers=server.headers, timeout=120).json()
    after_generate = token_counts(server)
    seqs = reassemble(stream(server, "/generate/stream", body))
    after_stream = token_counts(server)
    assert len(seqs) == 4
    for c in outs:
        s = seqs[(c["prompt_index"], c["sample_index"])]
        assert s["token_ids"] == c["token_ids"] and s["finish_reason"] == c["finish_reason"]
    # the metrics count a streamed request as they count the same request generated: each prompt once
    generated = sum(len(c["token_ids"]) for c in outs)
    assert [a - b for a, b in zip(after_generate, before, strict=True)] == [5, generated]
    assert [a - b for a, b in zip(after_stream, after_generate, strict=True)] == [5, generated]
    deadline = time.monotonic() + 10  # counted once the response is complete, just after the client has it
    while 'rollout_requests_total{endpoint="/generate/stream",status="200"}' not in (
            httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text):
        assert time.monotonic() < deadline, "the stream was not counted in the metrics"
        time.sleep(0.05)


def test_a_streamed_text_prompt_counts_its_tokens_as_a_generated_one(thread_server):
    """Text prompts are tokenized by the engine; the server counts a streamed one's tokens itself
    (in a thread), and its count equals the engine's for the same request generated."""
    body = {"prompts": ["The quick brown fox", "Hello there"], "sampling": {**GREEDY, "n": 2}}
    before = token_counts(thread_server)
    outs = httpx.post(thread_server.url + "/generate", json=body, headers=thread_server.headers, timeout=120).json()
    after_generate = token_counts(thread_server)
    reassemble(stream(thread_server, "/generate/stream", body))
    after_stream = token_counts(thread_server)
    prompt_tokens = sum(len(c["prompt_token_ids"]) for c in outs if c["sample_index"] == 0)
    assert prompt_tokens > 2
    assert after_generate[0] - before[0] == after_stream[0] - after_generate[0] == prompt_tokens


def test_stream_is_incremental(scripted):
    """Deltas arrive while the sequence is being made, not all at the end."""
    body = {"prompt_token_ids": [[5]], "sampling": {"max_tokens": 20}}
    arrivals = []
    with httpx.stream("POST", scripted.url + "/generate/stream", json=body, headers=scripted.headers,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 20
    assert arrivals[-1] - arrivals[0] > 10 * scripted.engine.step_s


def test_stream_errors_before_the_start_are_typed_json(thread_server, scripted):
    h = thread_server.headers
    r = httpx.post(thread_server.url + "/generate/stream", json={"prompt_token_ids": [[1, 99_999]]}, headers=h,
                   timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "prompt_token_ids"
    r = httpx.post(thread_server.url + "/generate/stream", json={"prompts": []}, headers=h, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["type"] == "ValidationError"
    r = httpx.post(scripted.url + "/generate/stream", json={"messages": [[{"role": "user", "content": "x"}]]},
                   headers=scripted.headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "CapabilityError"
    r = httpx.post(scripted.url + "/generate/stream", json={"prompt_token_ids": [[1]]}, timeout=30)
    assert r.status_code == 401


def test_client_disconnect_closes_the_engine_stream(scripted):
    engine = scripted.engine
    before = engine.closed_streams
    body = {"prompt_token_ids": [[5]], "sampling": {"max_tokens": 100_000}, "request_ids": ["gone-1"]}
    with httpx.stream("POST", scripted.url + "/generate/stream", json=body, headers=scripted.headers,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 10
    while engine.closed_streams == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.closed_streams == before + 1 and "gone-1" not in engine.running


# ---- /abort --------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["transformers", "scripted"])
def test_abort_by_id_ends_a_running_stream(which, thread_server, scripted):
    server = thread_server if which == "transformers" else scripted
    need(server, "abort")
    ids = ["keep-going", "stop-me"]
    # The scripted engine runs its sequences one after the other, a token per 20 ms; the tiny model's
    # context is 2048.
    max_tokens = 1500 if which == "transformers" else 400
    body = {"prompt_token_ids": [[5, 6], [7, 8]], "request_ids": ids,
            "sampling": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}
    t, events, started = stream_in_thread(server, "/generate/stream", body)
    assert started.wait(60), "no token streamed within 60 s"
    r = httpx.post(server.url + "/abort", json={"request_ids": ["stop-me", "unknown-id"]}, headers=server.headers,
                   timeout=30)
    assert r.status_code == 200 and r.json()["ok"] is True
    t.join(120)
    assert not t.is_alive() and events[-1] == "[DONE]"
    seqs = {s["request_id"]: s for s in reassemble(events[:-1]).values()}
    assert seqs["stop-me"]["finish_reason"] == "abort" and len(seqs["stop-me"]["token_ids"]) < max_tokens
    assert seqs["keep-going"]["finish_reason"] == "length" and len(seqs["keep-going"]["token_ids"]) == max_tokens


def test_abort_body_and_capability(thread_server, scripted):
    for body in ({}, {"request_ids": ["a"], "all": True}, {"request_ids": [""]}, {"all": True, "extra": 1}):
        r = httpx.post(scripted.url + "/abort", json=body, headers=scripted.headers, timeout=30)
        assert r.status_code == 422, (body, r.text)
    assert httpx.post(scripted.url + "/abort", json={"all": True}, headers=scripted.headers,
                      timeout=30).status_code == 200
    if not caps(thread_server).get("abort"):
        r = httpx.post(thread_server.url + "/abort", json={"all": True}, headers=thread_server.headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "CapabilityError"


# ---- vLLM's RL routes: /inference/v1/generate and its aborts --------------------------------------
def vllm_generate(server: ThreadServer, request_id: str, max_tokens: int,
                  n: int = 1) -> tuple[threading.Thread, dict[str, Any]]:
    """``POST /inference/v1/generate`` from a thread; its answer fills the dict returned beside it."""
    body = {"request_id": request_id, "token_ids": [5, 6], "sampling_params": {"max_tokens": max_tokens, "n": n}}
    answer: dict[str, Any] = {}

    def run() -> None:
        answer.update(httpx.post(server.url + "/inference/v1/generate", json=body, headers=server.headers,
                                 timeout=120).json())

    t = threading.Thread(target=run)
    t.start()
    return t, answer


def finish_reasons(call: tuple[threading.Thread, dict[str, Any]]) -> list[str]:
    call[0].join(120)
    return [c["finish_reason"] for c in call[1]["choices"]]


def test_vllm_rl_an_empty_id_list_aborts_nothing(scripted_vllm):
    engine = scripted_vllm.engine
    call = vllm_generate(scripted_vllm, "bystander", max_tokens=500)
    wait_until(lambda: "bystander" in engine.running, 30, "the request to start", every_s=0.01)
    with httpx.Client(base_url=scripted_vllm.url, headers=scripted_vllm.headers, timeout=30) as c:
        assert c.post("/inference/v1/abort_requests", json={"request_ids": []}).status_code == 200
        assert c.post("/abort_requests", json={"request_ids": []}).json() == {"status": "aborted", "aborted": 0}
        assert "bystander" in engine.running and "bystander" not in engine.aborted
        # No request_ids at all (on /abort_requests only): every request.
        assert c.post("/abort_requests", json={}).json() == {"status": "aborted", "aborted": 1}
    assert finish_reasons(call) == ["abort"]


def test_vllm_rl_a_refused_stream_leaves_nothing_running(scripted_vllm):
    r = httpx.post(scripted_vllm.url + "/inference/v1/generate", headers=scripted_vllm.headers, timeout=30, json={
        "request_id": "refused", "token_ids": [5, 6], "stream": True, "sampling_params": {"top_k": 5000}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "sampling.top_k", r.text
    r = httpx.post(scripted_vllm.url + "/abort_requests", headers=scripted_vllm.headers, timeout=30, json={})
    assert r.json()["aborted"] == 0, "the refused request is still counted as running"


def test_vllm_rl_a_reused_request_id_is_aborted_in_its_latest_request(scripted_vllm):
    engine = scripted_vllm.engine
    first = vllm_generate(scripted_vllm, "twin", max_tokens=100, n=2)
    wait_in_flight(scripted_vllm)
    second = vllm_generate(scripted_vllm, "twin", max_tokens=500, n=2)
    wait_until(lambda: outstanding(scripted_vllm) == 2, 30, "the second request to reach the engine", every_s=0.01)
    # The first one ends while the second runs: the id must still name the second's samples.
    assert finish_reasons(first) == ["length", "length"]
    r = httpx.post(scripted_vllm.url + "/abort_requests", headers=scripted_vllm.headers, timeout=30,
                   json={"request_ids": ["twin"]})
    assert r.json()["aborted"] == 1
    assert {"twin-0", "twin-1"} <= engine.aborted
    assert finish_reasons(second) == ["abort", "abort"]


# ---- /pause with a mode --------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["transformers", "scripted"])
def test_pause_modes_round_trip(which, thread_server, scripted):
    server = thread_server if which == "transformers" else scripted
    modes = ["wait", *caps(server).get("pause_modes", [])]
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        assert c.post("/pause").status_code == 200  # bodiless: wait
        assert c.post("/resume").status_code == 200
        for mode in dict.fromkeys(modes):
            assert c.post("/pause", json={"mode": mode}).status_code == 200, mode
            assert c.post("/resume").status_code == 200
        assert c.post("/generate", json={"prompt_token_ids": [[1, 2]], "sampling": GREEDY}).status_code == 200
        r = c.post("/pause", json={"mode": "sideways"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "mode"
        for mode in {"abort", "keep"} - set(modes):
            r = c.post("/pause", json={"mode": mode})
            assert r.status_code == 400 and r.json()["error"]["type"] == "CapabilityError"
            c.post("/resume")


def test_pause_abort_ends_streams_and_keep_holds_them(scripted):
    h = scripted.headers
    body = {"prompt_token_ids": [[5]], "sampling": {"max_tokens": 400}}
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.setdefault("events", stream(scripted, "/generate/stream", body)))
    t.start()
    wait_in_flight(scripted)
    time.sleep(0.2)
    assert httpx.post(scripted.url + "/pause", json={"mode": "abort"}, headers=h, timeout=30).status_code == 200
    t.join(60)
    assert httpx.post(scripted.url + "/resume", headers=h, timeout=30).status_code == 200
    (seq,) = reassemble(result["events"]).values()
    assert seq["finish_reason"] == "abort" and len(seq["token_ids"]) < 400
    # keep: the stream freezes, then continues after /resume to its full length
    n = 200  # 4 s of tokens: the pause lands long before the end
    t, events, started = stream_in_thread(scripted, "/generate/stream",
                                          {"prompt_token_ids": [[5]], "sampling": {"max_tokens": n}})
    assert started.wait(60), "no token streamed within 60 s"
    assert httpx.post(scripted.url + "/pause", json={"mode": "keep"}, headers=h, timeout=30).status_code == 200
    frozen_at = len(events)
    time.sleep(0.5)
    assert t.is_alive() and len(events) <= frozen_at + 1, "a kept stream must not move while paused"
    assert httpx.post(scripted.url + "/resume", headers=h, timeout=30).status_code == 200
    t.join(60)
    assert not t.is_alive() and events[-1] == "[DONE]"
    (seq,) = reassemble(events[:-1]).values()
    assert seq["finish_reason"] == "length" and len(seq["token_ids"]) == n


# ---- OpenAI streaming ----------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["transformers", "scripted"])
def test_openai_completion_chunks_reassemble(which, thread_server, scripted):
    server = thread_server if which == "transformers" else scripted
    body = {"prompt": ["The quick brown fox", "Hello"], "max_tokens": 10, "temperature": 0, "n": 2,
            "ignore_eos": True}
    before = token_counts(server)
    plain = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120).json()
    after_plain = token_counts(server)
    chunks = stream(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    after_stream = token_counts(server)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for ch in chunks[:-1]:
        assert ch["object"] == "text_completion" and len(ch["choices"]) == 1
        (c,) = ch["choices"]
        assert c["index"] not in finish, "a chunk after the choice's last one"
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"] is not None:
            finish[c["index"]] = c["finish_reason"]
    for c in plain["choices"]:
        assert texts[c["index"]] == c["text"]
        assert finish[c["index"]] == c["finish_reason"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == plain["usage"]["completion_tokens"]
    if which == "transformers":  # the scripted engine's prompt tokens are not its tokenizer's
        assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    # the metrics count what each answer's usage reports, streamed or not
    assert [a - b for a, b in zip(after_plain, before, strict=True)] == [plain["usage"]["prompt_tokens"],
                                                                          plain["usage"]["completion_tokens"]]
    assert [a - b for a, b in zip(after_stream, after_plain, strict=True)] == [usage["prompt_tokens"],
                                                                                usage["completion_tokens"]]


def test_openai_chat_chunks_reassemble(thread_server):
    server = thread_server
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}
    plain = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=120).json()
    assert plain["prompt_token_ids"] and plain["choices"][0]["token_ids"]
    chunks = stream(server, "/v1/chat/completions", {**body, "stream": True})
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["choices"][0]["delta"]["content"] or "" for ch in chunks)
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert sum((ch["choices"][0]["token_ids"] or [] for ch in chunks), []) == plain["choices"][0]["token_ids"]


@pytest.mark.parametrize("which", ["transformers", "scripted"])
def test_openai_client_streaming(which, thread_server, scripted):
    openai = pytest.importorskip("openai")
    server = thread_server if which == "transformers" else scripted
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
    name = client.models.list().data[0].id
    kwargs = {"model": name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    plain = client.completions.create(**kwargs)
    pieces = list(client.completions.create(**kwargs, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text
    assert pieces[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    if caps(server).get("chat"):
        chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
        plain_chat = client.chat.completions.create(**chat)
        parts = list(client.chat.completions.create(**chat, stream=True))
        assert "".join(p.choices[0].delta.content or "" for p in parts) == plain_chat.choices[0].message.content


# ---- echo + logprobs (log-likelihoods) -----------------------------------------------------------
@pytest.mark.parametrize("which", ["transformers", "scripted"])
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_shape(which, max_tokens, thread_server, scripted):
    server = thread_server if which == "transformers" else scripted
    prompt = [[5, 6, 7, 8], [9, 10, 11]]
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)
    if not caps(server).get("prompt_logprobs"):
        assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"], r.text
        pytest.skip("the served engine does not declare capability 'prompt_logprobs' (yet)")
    assert r.status_code == 200, r.text
    out = r.json()
    for choice, p in zip(out["choices"], prompt, strict=True):
        lp = choice["logprobs"]
        n = len(p) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
        for tok, x, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert top[tok] == x and max(top.values()) >= x  # the chosen token, and the most likely one(s)
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        assert choice["prompt_token_ids"] == p
        assert len(choice["token_ids"]) == max_tokens
    assert out["usage"]["completion_tokens"] == 2 * max_tokens


def test_max_tokens_zero_only_with_echo(scripted):
    r = httpx.post(scripted.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0},
                   headers=scripted.headers, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(scripted.url + "/v1/completions", json={"prompt": "hi", "echo": True, "max_tokens": 0},
                   headers=scripted.headers, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"  # echo without logprobs: the prompt
    r = httpx.post(scripted.url + "/v1/completions", json={"prompt": "hi", "echo": True, "stream": True},
                   headers=scripted.headers, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "echo"


def test_protocols_select_the_routes(thread_server, tiny_model):
    from rollout_engines_remote.server import build_parser, create_app, fastapi_app

    only = create_app(thread_server.engine, api_key="k", protocols=["openai"], close_engine=False)
    paths = set(fastapi_app(only).openapi()["paths"])
    assert "/v1/completions" in paths and "/info" in paths and "/generate" not in paths
    with pytest.raises(ValueError, match="unknown protocol"):
        create_app(thread_server.engine, api_key="k", protocols=["grpc"])
    assert build_parser().parse_args(["--model", "m"]).protocols == "openai,native"


def test_echo_logprobs_need_the_prompt_logprobs_capability():
    from rollout_engines.errors import CapabilityError
    from rollout_engines_remote.openai_api import CompletionRequest

    body = CompletionRequest(prompt=[[5, 6]], echo=True, logprobs=1, max_tokens=0)
    with pytest.raises(CapabilityError, match="prompt_logprobs"):
        body.to_core(Capabilities(prompt_logprobs=False))
    req = body.to_core(Capabilities(prompt_logprobs=True, top_logprobs=5))
    assert req.sampling.max_tokens == 1 and req.sampling.prompt_logprobs == 1 and req.sampling.top_logprobs == 1
