"""vLLM's runtime LoRA routes on a real server (uvicorn on 127.0.0.1): ``/v1/load_lora_adapter`` reads
a PEFT folder under ``--weights-root``, ``"model": <adapter>`` selects it on the OpenAI routes,
``/v1/models`` lists it, ``/v1/unload_lora_adapter`` drops it; answers as vLLM's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import rollout_engines as roe
import torch
from rollout_engines.testing.conformance import make_lora
from rollout_engines.weights.checkpoint import load_checkpoint
from rollout_engines.weights.lora import save_peft_adapter

from .conftest import ThreadServer, start_thread_server

pytestmark = pytest.mark.remote

PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def lora_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    root = tmp_path_factory.mktemp("weights-root")
    engine = roe.create_engine("transformers", model=str(tiny_model), dtype="float32")
    server = start_thread_server(engine, weights_root=str(root), model_name="tiny")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def adapters(lora_server: ThreadServer, tiny_model: Path) -> dict[str, Path]:
    """Two adapters of the tiny model in the server's weights root, and one outside it."""
    root = Path(str(lora_server.app.app.state.roe.weights_root))
    weights = load_checkpoint(str(tiny_model), torch.float32)
    out = {}
    for key, seed in (("a", 1), ("b", 2)):
        spec, tensors = make_lora(weights, "x", seed=seed)
        out[key] = save_peft_adapter(root / f"adapter-{key}", spec, tensors)
    spec, tensors = make_lora(weights, "x", seed=3)
    out["outside"] = save_peft_adapter(root.parent / f"{root.name}-outside", spec, tensors)
    return out


def complete(c: httpx.Client, model: str) -> dict[str, Any]:
    r = c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return dict(r.json())


def ids(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def test_load_select_list_replace_unload(lora_server: ThreadServer, adapters: dict[str, Path]) -> None:
    with httpx.Client(base_url=lora_server.url, headers=lora_server.headers, timeout=120) as c:
        base = ids(complete(c, "tiny"))
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "adapter-a"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
        assert c.get("/info").json()["loras"] == {"sql": 1}

        answer = complete(c, "sql")
        first = ids(answer)
        assert answer["model"] == "sql" and first != base
        native = c.post("/generate", json={"prompt_token_ids": [PROMPT], "lora": "sql", "sampling": {
            "temperature": 0, "max_tokens": 8, "ignore_eos": True}}).json()
        assert native[0]["token_ids"] == first and native[0]["lora_version"] == 1
        chat = c.post("/v1/chat/completions", json={"model": "sql", "max_tokens": 4, "temperature": 0,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["model"] == "sql"
        with c.stream("POST", "/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": 8,
                                                        "temperature": 0, "ignore_eos": True, "stream": True,
                                                        "return_token_ids": True}) as streamed:
            chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
        assert {chunk["model"] for chunk in chunks} == {"sql"}
        assert [t for chunk in chunks for t in chunk["choices"][0]["token_ids"] or []] == first
        assert ids(complete(c, "tiny")) == base, "the base model is untouched"

        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert set(cards) == {"tiny", "sql"}
        assert cards["sql"]["parent"] == "tiny" and cards["tiny"]["parent"] is None

        # A loaded name: refused without load_inplace (vLLM's 400), replaced as the next version with it.
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "adapter-b"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidUserInput"
        assert "load_inplace" in r.json()["error"]["message"] and ids(complete(c, "sql")) == first
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapters["b"]),
                                                  "load_inplace": True})
        assert r.status_code == 200, r.text
        assert c.get("/info").json()["loras"] == {"sql": 2}
        second = ids(complete(c, "sql"))
        assert second not in (first, base)

        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 404 and r.json()["error"] == {
            "type": "NotFoundError", "message": "The lora adapter 'sql' cannot be found.", "param": "lora_name"}
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny"]
        assert c.get("/info").json()["loras"] == {}
        # No longer an adapter: the name is any client's model name again, the base model.
        assert ids(complete(c, "sql")) == base
        r = c.post("/generate", json={"prompt_token_ids": [PROMPT], "lora": "sql"})
        assert r.status_code == 422 and "sql" in r.json()["error"]["message"]

        # A name unloaded starts again at version 1.
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "adapter-a"}).status_code == 200
        assert c.get("/info").json()["loras"] == {"sql": 1} and ids(complete(c, "sql")) == first
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200


def test_paths_stay_inside_the_weights_root(lora_server: ThreadServer, adapters: dict[str, Path]) -> None:
    root = adapters["a"].parent
    (root / "escape").symlink_to(adapters["outside"])
    (root / "not-peft").mkdir()
    with httpx.Client(base_url=lora_server.url, headers=lora_server.headers, timeout=60) as c:
        for path in (str(adapters["outside"]), f"../{adapters['outside'].name}", "escape", "/etc"):
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": path})
            assert r.status_code == 403, r.text
            error = r.json()["error"]
            assert error["type"] == "Forbidden" and error["param"] == "lora_path" and "weights root" in error["message"]
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": "missing"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        assert "No adapter found" in r.json()["error"]["message"]
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": "not-peft"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        assert "adapter_config.json" in r.json()["error"]["message"]
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": "adapter-a"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidUserInput"
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "../x", "lora_path": "adapter-a"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "lora_name"
        assert c.get("/info").json()["loras"] == {}


def test_an_adapter_the_engine_refuses_is_a_400(lora_server: ThreadServer, tiny_model: Path) -> None:
    root = Path(str(lora_server.app.app.state.roe.weights_root))
    spec, tensors = make_lora(load_checkpoint(str(tiny_model), torch.float32), "x", rank=4)
    wrong = {n.replace("q_proj", "k_proj"): t for n, t in tensors.items()}  # names disagree with the config
    save_peft_adapter(root / "mismatched", spec, wrong)
    with httpx.Client(base_url=lora_server.url, headers=lora_server.headers, timeout=60) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "mismatched"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", r.text
        assert "nothing installed" in r.json()["error"]["message"]
        assert c.get("/info").json()["loras"] == {}


def test_routes_need_the_key(lora_server: ThreadServer) -> None:
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "adapter-a"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
        assert httpx.post(lora_server.url + path, json=body, timeout=30).status_code == 401
        assert httpx.post(lora_server.url + path, json=body, timeout=30,
                          headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(lora_server.url + "/info", headers=lora_server.headers, timeout=30).json()["loras"] == {}


def test_without_a_weights_root_loading_is_refused(thread_server: ThreadServer, adapters: dict[str, Path]) -> None:
    r = httpx.post(thread_server.url + "/v1/load_lora_adapter", headers=thread_server.headers, timeout=30,
                   json={"lora_name": "sql", "lora_path": str(adapters["a"])})
    assert r.status_code == 403 and "--weights-root" in r.json()["error"]["message"]


def test_the_openai_client_loads_and_selects_an_adapter(lora_server: ThreadServer, adapters: dict[str, Path]) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key=lora_server.api_key, max_retries=0)
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    answer = client.post("/load_lora_adapter", body={"lora_name": "oai", "lora_path": "adapter-a"},
                         cast_to=httpx.Response)
    assert answer.text == "Success: LoRA adapter 'oai' added successfully."
    try:
        assert "oai" in [m.id for m in client.models.list()]
        tuned = client.completions.create(model="oai", prompt=PROMPT, max_tokens=6, temperature=0)
        assert tuned.model == "oai" and tuned.choices[0].text != base.choices[0].text
    finally:
        client.post("/unload_lora_adapter", body={"lora_name": "oai"}, cast_to=httpx.Response)
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", body={"lora_name": "oai"}, cast_to=httpx.Response)


def test_skyrl_loads_or_replaces(tiny_model: Path, adapters: dict[str, Path], lora_server: ThreadServer) -> None:
    server = start_thread_server(lora_server.engine, weights_root=str(adapters["a"].parent), close_engine=False,
                                 protocols=("skyrl", "openai"))
    try:
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
            for version, path in ((1, "adapter-a"), (2, "adapter-b")):
                r = c.post("/skyrl/v1/load_lora_adapter", json={"lora_name": "sky", "lora_path": path})
                assert r.status_code == 200, r.text
                assert c.get("/info").json()["loras"] == {"sky": version}
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "sky"}).status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize(("broken", "says"), [
    ({"r": None}, "r: Field required"),
    ({"r": "four"}, "r: Input should be a valid integer"),
    ({"lora_alpha": [16]}, "lora_alpha: Input should be a valid number"),
    ({"use_rslora": "sometimes"}, "use_rslora: Input should be a valid boolean"),
    ([], "must hold a JSON object"),
    (b"not a safetensors file", "not a readable safetensors file"),
])
def test_a_malformed_adapter_folder_is_a_400_saying_what_is_wrong(lora_server: ThreadServer, tiny_model: Path,
                                                                  broken: Any, says: str) -> None:
    """``broken``: keys to change in adapter_config.json (None: remove), a whole config, or the weights' bytes."""
    root = Path(str(lora_server.app.app.state.roe.weights_root))
    spec, tensors = make_lora(load_checkpoint(str(tiny_model), torch.float32), "x", rank=4)
    folder = save_peft_adapter(root / "malformed", spec, tensors)
    config = json.loads((folder / "adapter_config.json").read_text())
    if isinstance(broken, bytes):
        (folder / "adapter_model.safetensors").write_bytes(broken)
    elif isinstance(broken, dict):
        config.update(broken)
        config = {k: v for k, v in config.items() if v is not None}
    else:
        config = broken
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with httpx.Client(base_url=lora_server.url, headers=lora_server.headers, timeout=60) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "malformed"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", r.text
        assert says in r.json()["error"]["message"]
        assert c.get("/info").json()["loras"] == {}
