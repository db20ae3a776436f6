"""LoRA adapters through a served engine: pushed over the ``http`` transport (the manifest carries
``lora``), chosen per request through ``/generate``, listed by ``/info``, dropped with
``POST /lora/unload``. The server is a real ``rollout-engines serve`` child process on 127.0.0.1."""

from __future__ import annotations

import httpx
import pytest
import rollout_engines as roe
import torch
from rollout_engines import InvalidRequest, ManifestMismatch, WeightSyncError
from rollout_engines.testing.conformance import make_lora
from rollout_engines.weights.checkpoint import load_checkpoint

from .conftest import API_KEY

pytestmark = pytest.mark.remote

PROMPTS = [[11, 12, 13, 14], [200, 300, 400]]


def request(lora: str | None = None) -> roe.GenerateRequest:
    return roe.GenerateRequest(prompt_token_ids=PROMPTS, lora=lora,
                               sampling=roe.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))


def tokens(outs: list[roe.Completion]) -> list[list[int]]:
    return [c.token_ids for c in outs]


async def test_an_adapter_pushed_over_http_serves_requests_until_unloaded(served, remote_options, tiny_model):
    original = load_checkpoint(str(tiny_model), torch.float32)
    spec, tensors = make_lora(original, "remote-a", seed=5)
    local = roe.create_engine("transformers", model=str(tiny_model), dtype="float32")
    try:
        async with await roe.connect_weight_sync([local], transport="inproc") as sync:
            await sync.push_lora(spec, tensors, version=4)
        expected = tokens(await local.generate(request("remote-a")))
    finally:
        await local.close()

    remote = roe.create_engine("remote", model=served.url, **remote_options)
    try:
        assert remote.capabilities.lora >= spec.rank and remote.capabilities.max_loras >= 1
        base = await remote.generate(request())
        version = remote.weight_version
        async with await roe.connect_weight_sync([remote], transport="http", bucket_bytes=16 * 1024) as sync:
            assert await sync.push_lora(spec, tensors, version=4) == 4
            # A bad adapter is refused by the server's engine, typed, and changes nothing.
            bad = spec.model_copy(update={"name": "remote-bad", "target_modules": ["not_a_layer"]})
            with pytest.raises(WeightSyncError) as refused:
                await sync.push_lora(bad, tensors, version=1)
            assert isinstance(refused.value, ManifestMismatch) and "not_a_layer" in str(refused.value)
        assert remote.weight_version == version, "a LoRA push leaves the base weights' version alone"
        assert remote.loras == {"remote-a": 4} and (await remote.info()).loras == {"remote-a": 4}
        outs = await remote.generate(request("remote-a"))
        assert tokens(outs) == expected != tokens(base)
        assert {(c.lora, c.lora_version) for c in outs} == {("remote-a", 4)}
        assert await remote.unload_lora("remote-a") is True
        assert await remote.unload_lora("remote-a") is False
        assert remote.loras == {} and (await remote.info()).loras == {}
        assert tokens(await remote.generate(request())) == tokens(base)
        with pytest.raises(InvalidRequest, match="remote-a"):
            await remote.generate(request("remote-a"))
    finally:
        await remote.close()


def test_unloading_needs_the_key_and_a_valid_name(served):
    url = f"{served.url}/lora/unload"
    assert httpx.post(url, json={"name": "x"}).status_code == 401
    auth = {"authorization": f"Bearer {API_KEY}"}
    answer = httpx.post(url, json={"name": "never-loaded"}, headers=auth)
    assert answer.status_code == 200 and answer.json() == {"ok": True, "unloaded": False}
    assert httpx.post(url, json={"name": "../etc"}, headers=auth).status_code == 422
