"""SkyRL's real ``RemoteInferenceClient`` (skyrl==0.3.0) against ``serve`` (protocols ``skyrl`` +
``openai``). SkyRL's client sends no API key, so the server runs with ``insecure_no_auth`` on
127.0.0.1, as a SkyRL deployment of ``serve`` must (``--insecure-no-auth``, loopback only)."""

from __future__ import annotations

import base64
import sys
import typing
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

if sys.version_info < (3, 12):
    # skyrl 0.3.0 declares Python >= 3.11 but builds pydantic models on typing.TypedDict, which
    # pydantic refuses before 3.12: give it typing_extensions' (the same class on 3.12+).
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
pytest.importorskip("skyrl")
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (  # noqa: E402
    RemoteInferenceClient,
)

pytestmark = [pytest.mark.interop, pytest.mark.transformers, pytest.mark.remote]


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("weights-root")
    return start_server(api_key=None, insecure_no_auth=True, protocols=("skyrl", "openai"), weights_root=str(root))


@pytest.fixture
async def client(server: Any) -> AsyncIterator[RemoteInferenceClient]:
    c = RemoteInferenceClient(proxy_url=server.url, server_urls=[server.url], data_parallel_size=1,
                              model_name=server.engine.model)
    yield c
    await c.teardown()


GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


async def test_generate(client: RemoteInferenceClient) -> None:
    out = await client.generate({"prompt_token_ids": [[1, 2, 3], [4, 5, 6, 7]], "session_ids": ["a", "b"],
                                 "sampling_params": {**GREEDY, "logprobs": 0}})
    assert [len(ids) for ids in out["response_ids"]] == [6, 6]
    assert out["stop_reasons"] == ["length", "length"]
    assert [len(lp) for lp in out["response_logprobs"]] == [6, 6]
    assert all(isinstance(text, str) for text in out["responses"])  # detokenized by the server
    again = await client.generate({"prompt_token_ids": [[1, 2, 3]], "sampling_params": GREEDY})
    assert again["response_ids"][0] == out["response_ids"][0]


async def test_tokenize_detokenize_world_size(client: RemoteInferenceClient) -> None:
    ids = (await client.tokenize(["hello world"]))[0]
    assert ids and all(isinstance(i, int) for i in ids)
    assert (await client.detokenize([ids]))[0].strip().endswith("world")
    assert await client.get_world_size() == (1, 1)
    await client.finish_session("a")


async def test_pause_resume(client: RemoteInferenceClient, server: Any) -> None:
    for mode in ("keep", "abort", "wait"):
        await client.pause(mode=mode, clear_cache=True)
        assert server.engine._paused
        assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": True}
        await client.resume()
        assert not server.engine._paused
    await client.pause_generation()
    await client.resume_generation()
    await client.reset_prefix_cache()
    assert (await client.generate({"prompt_token_ids": [[1, 2]], "sampling_params": GREEDY}))["response_ids"]


async def test_sleep_wake(client: RemoteInferenceClient, server: Any) -> None:
    await client.sleep(level=1)
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": True}
    await client.wake_up(tags=["weights"])
    await client.wake_up()
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": False}
    assert (await client.generate({"prompt_token_ids": [[1, 2]], "sampling_params": GREEDY}))["response_ids"]


class HttpInitInfo:
    """A SkyRL ``WeightSyncInitInfo`` for the server's CPU path (``backend: http``)."""

    def for_servers(self, world_size_per_server: int, num_servers: int, dp_size: int = 1) -> list[HttpInitInfo]:
        return [self] * num_servers

    def to_api_payload(self) -> dict[str, Any]:
        return {"backend": "http"}


async def test_weight_sync(client: RemoteInferenceClient, server: Any, tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    before = (await client.generate({"prompt_token_ids": [[1, 2, 3]], "sampling_params": GREEDY}))["response_ids"][0]
    version = server.engine.weight_version
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    torch.manual_seed(1)
    info: dict[str, Any] = {"names": [], "dtype_names": [], "shapes": [], "data_b64": []}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.5)
            info["names"].append(name)
            info["dtype_names"].append(str(p.dtype).split(".")[-1])
            info["shapes"].append(list(p.shape))
            info["data_b64"].append(base64.b64encode(p.numpy().tobytes()).decode())

    await client.init_weight_update_communicator(HttpInitInfo())
    await client.pause(mode="keep")
    await client.start_weight_update(is_checkpoint_format=True)  # /collective_rpc
    await client.update_named_weights(info)  # /update_weights
    await client.finish_weight_update()  # /collective_rpc
    await client.resume()

    assert server.engine.weight_version == version + 1
    after = (await client.generate({"prompt_token_ids": [[1, 2, 3]], "sampling_params": GREEDY}))["response_ids"][0]
    assert after != before


async def test_load_lora_adapter(client: RemoteInferenceClient, server: Any, tiny_model: Path) -> None:
    """SkyRL's ``load_lora_adapter`` loads a PEFT folder from inside the server's weights root (a
    second load replaces it: version 2) and is refused for a path outside it."""
    import aiohttp
    import torch
    from rollout_engines.weights.checkpoint import load_checkpoint
    from rollout_engines.weights.lora import make_lora, save_peft_adapter

    root = Path(str(server.app.app.state.roe.weights_root))
    weights = load_checkpoint(str(tiny_model), torch.float32)
    spec, tensors = make_lora(weights, "skyrl-lora", seed=1)
    folder = save_peft_adapter(root / "skyrl-lora", spec, tensors)
    await client.load_lora_adapter("skyrl-lora", str(folder))
    assert (await server.engine.info()).loras == {"skyrl-lora": 1}
    await client.load_lora_adapter("skyrl-lora", str(folder))
    assert (await server.engine.info()).loras == {"skyrl-lora": 2}
    outside = save_peft_adapter(root.parent / f"{root.name}-outside", spec, tensors)
    with pytest.raises(aiohttp.ClientResponseError) as err:
        await client.load_lora_adapter("other", str(outside))
    assert err.value.status == 403
    await server.engine.unload_lora("skyrl-lora")
