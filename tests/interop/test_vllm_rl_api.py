"""vLLM's RL HTTP API on ``serve`` (protocol ``vllm-rl``), driven by plain HTTP calls shaped like
vLLM's own client code: ``examples/rl/rlhf_http_nccl.py`` (``requests.post(f"{base_url}/...",
json={"init_info": ...})``...), ``HTTPVLLMWeightSyncClient`` and ``/inference/v1/generate``."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.interop, pytest.mark.transformers, pytest.mark.remote]

PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Any]) -> Any:
    return start_server(protocols=("vllm-rl", "openai"))


def post(server: Any, path: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/{path.lstrip('/')}", headers=server.headers, timeout=120, **kw)


def get(server: Any, path: str, **kw: Any) -> httpx.Response:
    return httpx.get(f"{server.url}/{path.lstrip('/')}", headers=server.headers, timeout=60, **kw)


def greedy(server: Any, max_tokens: int = 8) -> dict[str, Any]:
    r = post(server, "/inference/v1/generate", json={
        "token_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens, "logprobs": 1,
                                                 "ignore_eos": True, "skip_special_tokens": True}})
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_token_in_token_out(server: Any) -> None:
    body = greedy(server)
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 8
    assert choice["finish_reason"] == "length"
    assert [c["token_id"] for c in choice["logprobs"]["content"]] == choice["token_ids"]
    assert all(len(c["top_logprobs"]) >= 1 for c in choice["logprobs"]["content"])
    assert choice["weight_versions"][0]["version"] == str(server.engine.weight_version)
    assert greedy(server)["choices"][0]["token_ids"] == choice["token_ids"]  # greedy is deterministic

    r = post(server, "/inference/v1/generate", json={
        "request_id": "abc", "token_ids": PROMPT, "return_token_ids": True,
        "sampling_params": {"n": 2, "max_tokens": 3, "seed": 7, "prompt_logprobs": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"] == "abc" and body["prompt_token_ids"] == PROMPT
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(PROMPT)


def test_generate_stream(server: Any) -> None:
    with httpx.stream("POST", f"{server.url}/inference/v1/generate", headers=server.headers, timeout=60, json={
            "token_ids": PROMPT, "stream": True, "return_token_ids": True,
            "sampling_params": {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    import json

    chunks = [json.loads(x) for x in lines[:-1]]
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert tokens == greedy(server, 4)["choices"][0]["token_ids"]
    assert chunks[0]["prompt_token_ids"] == PROMPT and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_return_token_ids(server: Any) -> None:
    r = post(server, "/v1/completions", json={"model": server.engine.model, "prompt": PROMPT, "max_tokens": 4,
                                              "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 4


def test_unserved_sampling_param_is_400(server: Any) -> None:
    r = post(server, "/inference/v1/generate", json={"token_ids": PROMPT,
                                                     "sampling_params": {"repetition_penalty": 1.3}})
    assert r.status_code == 422 and "repetition_penalty" in r.text


def test_pause_resume_abort_sleep_wake(server: Any) -> None:
    assert post(server, "/pause").json() == {"status": "paused"}  # vLLM's default mode: abort
    assert get(server, "/is_paused").json() == {"is_paused": True}
    assert post(server, "/resume").json() == {"status": "resumed"}
    assert get(server, "/is_paused").json() == {"is_paused": False}
    for mode in ("wait", "keep"):
        assert post(server, "/pause", params={"mode": mode, "clear_cache": "false"}).status_code == 200
        assert post(server, "/resume").status_code == 200
    assert post(server, "/pause", params={"mode": "bogus"}).status_code == 422
    assert post(server, "/abort_requests", json={}).json()["status"] == "aborted"
    assert post(server, "/abort_requests", json={"request_ids": ["nope"]}).json()["aborted"] == 1
    assert post(server, "/inference/v1/abort_requests", json={"request_ids": ["nope"]}).status_code == 200
    assert post(server, "/reset_prefix_cache").json() == {"success": True}

    assert post(server, "/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
    assert get(server, "/is_sleeping").json() == {"is_sleeping": True}
    assert post(server, "/inference/v1/generate", json={"token_ids": PROMPT}).status_code == 409
    assert post(server, "/wake_up", params={"tags": ["kv_cache"]}).json()["status"] == "sleeping"
    assert post(server, "/wake_up").json()["status"] == "awake"
    assert get(server, "/is_sleeping").json() == {"is_sleeping": False}
    assert greedy(server)["choices"][0]["token_ids"]


def test_unsupported_is_4xx(server: Any) -> None:
    r = post(server, "/init_weight_transfer_engine", json={"init_info": {
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "backend": "nccl"}})
    assert r.status_code == 400 and "TransportSpec" in r.text and "http" in r.text
    r = post(server, "/init_weight_transfer_engine", json={"init_info": {"backend": "sharded_rdt"}})
    assert r.status_code == 400 and "sharded_rdt" in r.text
    assert post(server, "/weight_checker", json={"action": "checksum"}).status_code == 400
    assert post(server, "/update_weight_version", json={"new_version": "7"}).status_code == 400
    assert post(server, "/start_draft_weight_update").status_code == 400


def _chunks(model: Any, limit: int = 2 * 2**20) -> Iterator[dict[str, Any]]:
    """``update_info`` chunks of the model's parameters: vLLM's fields plus ``data_b64``."""
    info: dict[str, Any] = {"names": [], "dtype_names": [], "shapes": [], "data_b64": []}
    size = 0
    for name, p in model.named_parameters():
        raw = p.detach().contiguous().cpu().numpy().tobytes()
        if info["names"] and size + len(raw) > limit:
            yield info
            info, size = {"names": [], "dtype_names": [], "shapes": [], "data_b64": []}, 0
        info["names"].append(name)
        info["dtype_names"].append(str(p.dtype).split(".")[-1])
        info["shapes"].append(list(p.shape))
        info["data_b64"].append(base64.b64encode(raw).decode())
        size += len(raw)
    if info["names"]:
        yield info


def test_weight_update_changes_outputs_and_version(server: Any, tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    before = greedy(server)["choices"][0]["token_ids"]
    version = int(get(server, "/weight_info").json()["weight_version"])
    assert get(server, "/get_world_size").json() == {"world_size": 1}

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)

    # The example's sequence: init (our CPU backend), pause, start, update (chunks), finish, resume.
    r = post(server, "/init_weight_transfer_engine", json={"init_info": {"backend": "http"}})
    assert r.status_code == 200, r.text
    assert post(server, "/pause", params={"mode": "keep"}).status_code == 200
    assert post(server, "/start_weight_update", json={"is_checkpoint_format": True}).status_code == 200
    chunks = list(_chunks(model))
    assert len(chunks) > 1
    for info in chunks:
        r = post(server, "/update_weights", json={"update_info": info})
        assert r.status_code == 200, r.text
    r = post(server, "/finish_weight_update", json={})
    assert r.status_code == 200, r.text
    assert post(server, "/resume").status_code == 200

    assert int(get(server, "/weight_info").json()["weight_version"]) == version + 1
    after = greedy(server)
    assert after["choices"][0]["token_ids"] != before
    assert after["choices"][0]["weight_versions"] == [{"version": str(version + 1), "start": 0, "end": 8}]

    # An incomplete update is refused before anything is applied; the version stays.
    assert post(server, "/start_weight_update").status_code == 200
    assert post(server, "/update_weights", json={"update_info": chunks[0]}).status_code == 200
    r = post(server, "/finish_weight_update", json={"weight_version": str(version + 5)})
    assert r.status_code == 422 and "missing" in r.text
    assert int(get(server, "/weight_info").json()["weight_version"]) == version + 1
    # A named integer version above the served one is used as the new version.
    assert post(server, "/start_weight_update").status_code == 200
    for info in chunks:
        assert post(server, "/update_weights", json={"update_info": info}).status_code == 200
    r = post(server, "/finish_weight_update", json={"weight_version": str(version + 5)})
    assert r.status_code == 200 and r.json()["weight_version"] == str(version + 5)
    assert post(server, "/shutdown_weight_transfer_engine").status_code == 200


def test_needs_the_key(server: Any) -> None:
    r = httpx.post(f"{server.url}/pause", timeout=10)
    assert r.status_code == 401
