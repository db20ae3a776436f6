"""The server's HTTP surface: auth on every endpoint, size limits, validation errors naming the
field, typed engine errors, the OpenAI-compatible endpoints and metrics."""

from __future__ import annotations

import httpx
import pytest
from rollout_engines_remote.server import fastapi_app

pytestmark = pytest.mark.remote

GREEDY = {"temperature": 0.0, "max_tokens": 6}


def protected_routes(app) -> list[tuple[str, str]]:
    schema = fastapi_app(app).openapi()
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops if p != "/health"]
    return routes + [("GET", "/openapi.json"), ("GET", "/docs")]


def test_every_endpoint_but_health_needs_the_key(thread_server):
    routes = protected_routes(thread_server.app)
    assert len(routes) >= 19
    with httpx.Client(base_url=thread_server.url, timeout=30) as c:
        for method, path in routes:
            for headers in ({}, {"authorization": "Bearer wrong-key"}, {"authorization": thread_server.api_key}):
                r = c.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json()["error"]["type"] == "Unauthorized"
                assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/health").status_code == 200
        assert c.get("/info", headers=thread_server.headers).status_code == 200


def test_oversized_body_is_413(thread_server):
    big = {"prompt_token_ids": [[1] * 40_000]}  # ~120 KB of JSON, over the 64 KiB limit
    with httpx.Client(base_url=thread_server.url, headers=thread_server.headers, timeout=30) as c:
        r = c.post("/generate", json=big)
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "PayloadTooLarge"

        def chunked():  # no Content-Length: the limit is enforced while reading
            yield b'{"prompt_token_ids": [[1'
            for _ in range(40_000):
                yield b",1"
            yield b"]]}"

        r = c.post("/generate", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        # A body under the limit still works on the same server.
        assert c.post("/generate", json={"prompt_token_ids": [[1, 2]], "sampling": GREEDY}).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"prompt_token_ids": [[1, 2]], "sampling": {"max_tokens": -1}}, "sampling.max_tokens"),
        ("/generate", {"prompt_token_ids": [[1, 2]], "sampling": {"top_p": 1.5}}, "sampling.top_p"),
        ("/generate", {"prompt_token_ids": [[1, 2]], "sampling": {"temprature": 0.5}}, "sampling.temprature"),
        ("/generate", {"prompt_token_ids": [[1, 99_999]]}, "prompt_token_ids"),
        ("/generate", {"prompt_token_ids": [[1]], "sampling": {"seed": 2**70}}, "sampling.seed"),
        ("/generate", {"messages": [[]]}, "messages.0"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stream": True, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("/sleep", {"level": "deep"}, "level"),
        ("/weights/init", {"session_id": "s"}, "transport"),
    ],
)
def test_invalid_params_are_422_naming_the_field(thread_server, path, body, param):
    r = httpx.post(thread_server.url + path, json=body, headers=thread_server.headers, timeout=30)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "ValidationError"
    assert error["param"] == param
    assert param in error["message"]


def test_malformed_json_is_422(thread_server):
    r = httpx.post(thread_server.url + "/generate", content=b'{"prompt_token_ids": [[1, 2]',
                   headers={**thread_server.headers, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 422
    assert r.json()["error"]["type"] == "ValidationError"
    assert "JSON" in r.json()["error"]["message"]


def test_neither_or_both_inputs_is_422(thread_server):
    for body in ({}, {"prompts": ["a"], "prompt_token_ids": [[1]]}):
        r = httpx.post(thread_server.url + "/generate", json=body, headers=thread_server.headers, timeout=30)
        assert r.status_code == 422
        assert "exactly one of prompt_token_ids, prompts or messages" in r.json()["error"]["message"]


def test_typed_engine_errors_keep_their_type(thread_server):
    with httpx.Client(base_url=thread_server.url, headers=thread_server.headers, timeout=60) as c:
        r = c.post("/sleep", json={"level": 3})
        assert r.status_code == 400 and r.json()["error"]["type"] == "CapabilityError"
        r = c.post("/weights/update", json={"version": 1, "tensors": [], "buckets": [], "total_bytes": 0,
                                            "transport": "http"})
        assert r.status_code == 409 and r.json()["error"]["type"] == "WeightSyncError"
        assert c.post("/sleep", json={"level": 1}).status_code == 200
        try:
            r = c.post("/generate", json={"prompt_token_ids": [[1, 2]], "sampling": GREEDY})
            assert r.status_code == 409
            assert r.json()["error"]["type"] == "EngineAsleep"
            assert "wake_up" in r.json()["error"]["message"]
        finally:
            assert c.post("/wake_up", json={}).status_code == 200
        assert c.post("/generate", json={"prompt_token_ids": [[1, 2]], "sampling": GREEDY}).status_code == 200


def test_openai_completions_match_native_generate(thread_server):
    with httpx.Client(base_url=thread_server.url, headers=thread_server.headers, timeout=60) as c:
        native = c.post("/generate", json={"prompt_token_ids": [[5, 6, 7], [8, 9]],
                                           "sampling": {**GREEDY, "logprobs": 1}}).json()
        r = c.post("/v1/completions", json={"model": "any", "prompt": [[5, 6, 7], [8, 9]], "temperature": 0,
                                            "max_tokens": 6, "logprobs": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion"
        assert [ch["index"] for ch in body["choices"]] == [0, 1]
        for ch, out in zip(body["choices"], native, strict=True):
            assert ch["text"] == out["text"]
            assert ch["token_ids"] == out["token_ids"]
            assert ch["logprobs"]["token_logprobs"] == pytest.approx(out["logprobs"])
            assert len(ch["logprobs"]["tokens"]) == len(out["token_ids"])
        assert body["usage"]["prompt_tokens"] == 5
        assert body["usage"]["completion_tokens"] == sum(len(o["token_ids"]) for o in native)
        assert body["usage"]["total_tokens"] == 5 + body["usage"]["completion_tokens"]

        r = c.post("/v1/completions", json={"prompt": "hello world", "n": 3, "max_tokens": 4, "seed": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3

        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "temperature": 0, "max_tokens": 5, "logprobs": True})
        assert r.status_code == 200, r.text
        chat = r.json()
        assert chat["object"] == "chat.completion"
        choice = chat["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert len(choice["logprobs"]["content"]) == chat["usage"]["completion_tokens"] > 0
        assert all(t["logprob"] <= 0 for t in choice["logprobs"]["content"])
        native_chat = c.post("/generate", json={"messages": [[{"role": "user", "content": "hi"}]],
                                                "sampling": {"temperature": 0, "max_tokens": 5}}).json()
        assert choice["message"]["content"] == native_chat[0]["text"]

        models = c.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == str(thread_server.engine.config.model)


def test_metrics_count_requests_and_tokens(thread_server):
    with httpx.Client(base_url=thread_server.url, headers=thread_server.headers, timeout=60) as c:
        def value(text: str, name: str) -> float:
            for line in text.splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        before = c.get("/metrics").text
        outs = c.post("/generate", json={"prompt_token_ids": [[1, 2], [3, 4]], "sampling": GREEDY}).json()
        after = c.get("/metrics").text
        generated = sum(len(o["token_ids"]) for o in outs)
        assert value(after, "rollout_generated_tokens_total") - value(before, "rollout_generated_tokens_total") == generated
        assert 'rollout_requests_total{endpoint="/generate",status="200"}' in after
        assert "rollout_weight_version" in after


def test_bad_bucket_frames_are_client_errors(thread_server):
    from rollout_engines_remote.transport import frame_prefix

    url = thread_server.url + "/weights/bucket"
    h = {**thread_server.headers, "content-type": "application/octet-stream"}
    with httpx.Client(timeout=30) as c:
        r = c.post(url, content=b"\x05\x00\x00\x00\x00\x00\x00\x00{}xyz", headers=h)
        assert r.status_code == 422 and r.json()["error"]["param"] == "body"
        r = c.post(url, content=b"\xff" * 8 + b"x", headers=h)  # header length far beyond the limit
        assert r.status_code == 422 and "header" in r.json()["error"]["message"]
        frame = frame_prefix({"session": "nope", "update": "u", "index": "0", "checksum": "0"}, 4) + b"abcd"
        r = c.post(url, content=frame[:-1], headers=h)  # Content-Length says one byte less
        assert r.status_code == 422 and r.json()["error"]["param"] == "content-length"
        r = c.post(url, content=iter([frame]), headers=h)  # chunked: no Content-Length
        assert r.status_code == 422 and r.json()["error"]["param"] == "content-length"
        r = c.post(url, content=frame, headers=h)  # well-formed, but no session is open
        assert r.status_code == 409 and r.json()["error"]["type"] == "WeightSyncError"
        assert "/weights/init" in r.json()["error"]["message"]


def test_oversized_bucket_is_413(tiny_model):
    import rollout_engines as roe

    from .conftest import start_thread_server

    engine = roe.create_engine("transformers", model=str(tiny_model))
    server = start_thread_server(engine, max_bucket_bytes=1024)
    try:
        r = httpx.post(server.url + "/weights/bucket", content=b"\0" * 2048, headers=server.headers, timeout=30)
        assert r.status_code == 413 and "1024" in r.json()["error"]["message"]
    finally:
        server.stop()
