"""The request checks of vLLM's RL routes (protocol ``vllm-rl``) and SkyRL's extras (``skyrl``) on a
real server (uvicorn on 127.0.0.1): malformed weight-transfer bodies and token ids are 422s naming
the field, and a refused ``/update_weights`` chunk changes nothing. The routes' happy paths, driven
as vLLM's and SkyRL's clients drive them, are ``tests/interop/test_vllm_rl_api.py`` and
``tests/interop/test_skyrl.py``."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import rollout_engines as roe
import torch

from .conftest import ThreadServer, start_thread_server

pytestmark = pytest.mark.remote

VOCAB = 4096  # the tiny model's
NORM = "model.norm.weight"  # float32[128] in the tiny model
LAYER_NORM = "model.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module")
def rl_server(tiny_model: Path) -> Iterator[ThreadServer]:
    engine = roe.create_engine("transformers", model=str(tiny_model))
    server = start_thread_server(engine, protocols=("skyrl", "vllm-rl"))
    yield server
    server.stop()


def post(server: ThreadServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=120)


def assert_422(r: httpx.Response, param: str) -> str:
    """The server's validation error naming ``param``; returns its message."""
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("ValidationError", param), error
    return str(error["message"])


def ones_b64(n: int = 128) -> str:
    return base64.b64encode(torch.ones(n, dtype=torch.float32).numpy().tobytes()).decode()


def chunk(names: list[str], data: list[str]) -> dict[str, Any]:
    return {"names": names, "dtype_names": ["float32"] * len(names), "shapes": [[128]] * len(names), "data_b64": data}


@pytest.mark.parametrize(("update_info", "param"), [
    ({**chunk([NORM], [ones_b64()]), "shapes": [128]}, "update_info.0.shapes.0"),
    ({**chunk([NORM], [ones_b64()]), "dtype_names": [["float32"]]}, "update_info.0.dtype_names.0"),
    ({**chunk([NORM], [ones_b64()]), "dtype_names": ["complex64"]}, "update_info.0.dtype_names"),
    ({**chunk([NORM], [ones_b64()]), "shapes": [[-1]]}, "update_info.0.shapes.0.0"),
    ([chunk([NORM], [ones_b64()]), {"names": [LAYER_NORM]}], "update_info.1.dtype_names"),
])
def test_malformed_update_info_is_422_naming_the_field(rl_server, update_info, param):
    assert post(rl_server, "/init_weight_transfer_engine", {"init_info": {"backend": "http"}}).status_code == 200
    assert post(rl_server, "/start_weight_update", {"partial": True}).status_code == 200
    assert_422(post(rl_server, "/update_weights", {"update_info": update_info}), param)
    # SkyRL's path to the same handler answers the same.
    r = post(rl_server, "/collective_rpc", {"method": "update_weights_ipc", "kwargs": {"update_info": update_info}})
    assert r.status_code == 422 and param in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(("init_info", "param", "says"), [
    ({"backend": "http", "timeout_s": [1]}, "init_info.timeout_s", "valid number"),
    ({"backend": "http", "timeout_s": 0}, "init_info.timeout_s", "must be > 0"),
    ({"backend": "nccl", "transport": "gloo", "session_id": "s"}, "init_info", "give one of them"),
])
def test_malformed_init_info_is_422_naming_the_field(rl_server, init_info, param, says):
    assert says in assert_422(post(rl_server, "/init_weight_transfer_engine", {"init_info": init_info}), param)


def test_backend_and_transport_may_both_name_the_transport(rl_server):
    # A TransportSpec's dump names its transport; a vLLM-style client may add the same as backend.
    # (A transport no engine has, so that nothing waits for a trainer.)
    r = post(rl_server, "/init_weight_transfer_engine", {"init_info": {
        "backend": "pigeon", "transport": "pigeon", "session_id": "s"}})
    assert r.status_code == 400 and "cannot receive weights over 'pigeon'" in r.json()["error"]["message"], r.text


def test_a_refused_update_chunk_keeps_none_of_its_tensors(rl_server):
    assert post(rl_server, "/init_weight_transfer_engine", {"init_info": {"backend": "http"}}).status_code == 200
    assert post(rl_server, "/start_weight_update", {"partial": True}).status_code == 200
    bad = chunk([NORM, LAYER_NORM], [ones_b64(), "not base64!"])
    assert "not base64" in assert_422(post(rl_server, "/update_weights", {"update_info": bad}),
                                      "update_info.data_b64")
    short = [chunk([NORM], [ones_b64()]), chunk([LAYER_NORM], [ones_b64(64)])]  # the list's second chunk is refused
    assert "bytes, expected" in assert_422(post(rl_server, "/update_weights", {"update_info": short}),
                                           "update_info.data_b64")
    twice = chunk([NORM, NORM], [ones_b64(), ones_b64()])
    assert "sent twice" in assert_422(post(rl_server, "/update_weights", {"update_info": twice}), "update_info.names")
    # The client corrects its chunk and sends it again: nothing of the refused ones was kept.
    good = chunk([NORM, LAYER_NORM], [ones_b64(), ones_b64()])
    r = post(rl_server, "/update_weights", {"update_info": good})
    assert r.status_code == 200, r.text
    assert "sent twice" in assert_422(post(rl_server, "/update_weights", {"update_info": chunk([NORM], [ones_b64()])}),
                                      "update_info.names")
    before = int(httpx.get(rl_server.url + "/weight_info", headers=rl_server.headers, timeout=30).json()["weight_version"])
    r = post(rl_server, "/finish_weight_update", {})
    assert r.status_code == 200 and r.json()["weight_version"] == str(before + 1), r.text


@pytest.mark.parametrize("tokens", [[-1], [VOCAB], [5, 2**40], [2**70]])
def test_detokenize_ids_outside_the_vocabulary_are_422(rl_server, tokens):
    assert "outside the vocabulary" in assert_422(post(rl_server, "/detokenize", {"tokens": tokens}), "tokens")
    assert post(rl_server, "/detokenize", {"tokens": [5, VOCAB - 1]}).status_code == 200
