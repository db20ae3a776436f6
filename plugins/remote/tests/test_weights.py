"""Weights into a served engine: the ``http`` transport (safetensors-framed buckets relayed into the
core receiver) and a ``gloo`` group set up through the server's control plane. The server is a
real ``rollout-engines serve`` child process; the trainer is this test process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import rollout_engines as roe
import torch
from rollout_engines.errors import WeightSyncError
from rollout_engines.weights.manifest import specs_of

from .conftest import start_thread_server

pytestmark = pytest.mark.remote

PROMPTS = [[11, 12, 13, 14], [200, 300, 400], [7]]
GREEDY = roe.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def request() -> roe.GenerateRequest:
    return roe.GenerateRequest(prompt_token_ids=PROMPTS, sampling=GREEDY)


def tokens(outs: list[roe.Completion]) -> list[list[int]]:
    return [c.token_ids for c in outs]


@pytest.fixture(scope="module")
def original(tiny_model) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in weights.items()}


@pytest.fixture
async def remote(served, remote_options):
    engine = roe.create_engine("remote", model=served.url, **remote_options)
    yield engine
    await engine.close()


async def restore(engine: roe.Engine, original: dict[str, torch.Tensor], transport: str = "http") -> None:
    info = await engine.info()
    async with await roe.connect_weight_sync([engine], transport=transport) as sync:
        await sync.push(original, version=info.weight_version + 1)


async def test_http_push_changes_outputs_like_an_in_process_push(remote, tiny_model, original):
    assert "http" in remote.capabilities.transports
    before = await remote.generate(request())
    start_version = remote.weight_version
    new = perturbed(original, seed=1)
    local = roe.create_engine("transformers", model=str(tiny_model))
    try:
        async with await roe.connect_weight_sync([local], transport="inproc") as sync:
            await sync.push(new, version=start_version + 1)
        expected = await local.generate(request())
    finally:
        await local.close()
    # Small buckets: many POSTs per push, pipelined.
    async with await roe.connect_weight_sync([remote], transport="http", bucket_bytes=64 * 1024) as sync:
        version = await sync.push(new, version=start_version + 1)
    assert version == start_version + 1 == remote.weight_version == (await remote.info()).weight_version
    after = await remote.generate(request())
    assert tokens(after) != tokens(before)
    assert tokens(after) == tokens(expected)
    assert {c.weight_version for c in after} == {version}
    await restore(remote, original)
    assert tokens(await remote.generate(request())) == tokens(before)


async def test_rejected_http_push_changes_nothing_and_the_next_works(remote, original):
    before = await remote.generate(request())
    version = remote.weight_version
    bad = dict(perturbed(original, seed=2))
    name = next(iter(bad))
    bad[name] = torch.zeros(3, 3)
    async with await roe.connect_weight_sync([remote], transport="http") as sync:
        with pytest.raises(WeightSyncError) as info:
            await sync.push(bad, version=version + 1)
        assert "ManifestMismatch" in repr(info.value.__cause__) or "shape" in str(info.value)
        assert remote.weight_version == version
        assert tokens(await remote.generate(request())) == tokens(before)
        await sync.push(perturbed(original, seed=2), version=version + 2)
    assert remote.weight_version == version + 2
    assert tokens(await remote.generate(request())) != tokens(before)
    await restore(remote, original)


async def test_trainer_failing_mid_stream_leaves_previous_weights(remote, original):
    before = await remote.generate(request())
    version = remote.weight_version
    new = perturbed(original, seed=3)
    items = list(new.items())

    def dying() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(items):
            if i == len(items) // 2:
                raise RuntimeError("trainer died while gathering shards")
            yield item

    async with await roe.connect_weight_sync([remote], transport="http", bucket_bytes=32 * 1024,
                                             timeout_s=60) as sync:
        with pytest.raises(WeightSyncError, match="trainer died|aborted"):
            await asyncio.wait_for(sync.push(dying(), version=version + 1, specs=specs_of(items)), 90)
        assert remote.weight_version == version
        assert tokens(await remote.generate(request())) == tokens(before)
        await sync.push(new, version=version + 2)
    assert tokens(await remote.generate(request())) != tokens(before)
    await restore(remote, original)


async def test_gloo_push_through_the_server(remote, original):
    assert "gloo" in remote.capabilities.transports
    before = await remote.generate(request())
    version = remote.weight_version
    async with await roe.connect_weight_sync([remote], transport="gloo", timeout_s=120) as sync:
        await sync.push(perturbed(original, seed=4), version=version + 1)
        assert remote.weight_version == version + 1
        changed = await remote.generate(request())
        assert tokens(changed) != tokens(before)
        assert {c.weight_version for c in changed} == {version + 1}
        await sync.push(original, version=version + 2)
    assert tokens(await remote.generate(request())) == tokens(before)


async def test_http_is_refused_for_an_engine_in_this_process(tiny_model):
    local = roe.create_engine("transformers", model=str(tiny_model))
    try:
        with pytest.raises((roe.CapabilityError, WeightSyncError), match="rollout-engines server"):
            await roe.connect_weight_sync([local], transport="http", timeout_s=5)
    finally:
        await local.close()


async def test_one_http_session_to_two_servers(remote, thread_server, original):
    other = roe.create_engine("remote", model=thread_server.url, api_key=thread_server.api_key)
    try:
        before = await remote.generate(request())
        assert tokens(await other.generate(request())) == tokens(before)
        version = max(remote.weight_version, other.weight_version) + 1
        async with await roe.connect_weight_sync([remote, other], transport="http", bucket_bytes=128 * 1024) as sync:
            await sync.push(perturbed(original, seed=5), version=version)
        a, b = await remote.generate(request()), await other.generate(request())
        assert tokens(a) == tokens(b) != tokens(before)
        assert remote.weight_version == other.weight_version == version
        async with await roe.connect_weight_sync([remote, other], transport="http") as sync:
            await sync.push(original, version=version + 1)
        assert tokens(await other.generate(request())) == tokens(before)
    finally:
        await other.close()


async def test_http_session_a_server_refuses_fails_at_once(tiny_model):
    """A server whose engine cannot join (closed here) answers /weights/init with its refusal at
    once, and the trainer's sender stops waiting for that server's endpoint: the session fails
    with the engine's reason in seconds, not after its timeout_s."""
    engine = roe.create_engine("transformers", model=str(tiny_model))
    server = start_thread_server(engine)
    remote = roe.create_engine("remote", model=server.url, api_key=server.api_key)
    try:
        await engine.close()
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="is closed") as info:
            await asyncio.wait_for(roe.connect_weight_sync([remote], transport="http", timeout_s=60), 20)
        assert isinstance(info.value.__cause__, roe.EngineClosed)
        assert time.monotonic() - start < 10
    finally:
        await remote.close()
        server.stop()


async def test_http_session_to_a_server_that_is_gone_fails_at_once(tiny_model):
    """A server that cannot be reached any more: the engine's failed /weights/init ends the
    sender's wait for its endpoint, naming the server (not 'not every engine joined in time')."""
    engine = roe.create_engine("transformers", model=str(tiny_model))
    server = start_thread_server(engine)
    remote = roe.create_engine("remote", model=server.url, api_key=server.api_key)
    try:
        server.stop()
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="did not join") as info:
            await asyncio.wait_for(roe.connect_weight_sync([remote], transport="http", timeout_s=60), 20)
        assert server.url in str(info.value)
        assert time.monotonic() - start < 10
    finally:
        await remote.close()
        await engine.close()


async def test_http_endpoints_keep_the_api_key_out_of_repr(remote, remote_options):
    """The sender's endpoints carry each server's key in their headers: never in their repr."""
    async with await roe.connect_weight_sync([remote], transport="http") as sync:
        endpoints = sync.sender.endpoints
        assert endpoints and endpoints[0].url == remote.url
        assert remote_options["api_key"] not in repr(endpoints)
        assert endpoints[0].headers["authorization"] == f"Bearer {remote_options['api_key']}"


async def test_a_bucket_fed_while_the_relay_begins_its_update_lands(tiny_model, original, monkeypatch):
    """The server relays each update's buckets into the engine through queues that tag them with
    their update: a bucket fed before the relay began its update went out as the previous update's
    and the engine dropped it (the update then waited out its timeout). The relay's start is slowed
    here (a fake delay, to open the window a busy server opens by chance)."""
    from rollout_engines.weights.buckets import alloc_bucket, pack_bucket
    from rollout_engines.weights.manifest import TransportSpec, plan_manifest
    from rollout_engines_remote.transport import HttpIngress, _RelaySender

    engine = roe.create_engine("transformers", model=str(tiny_model))
    ingress = HttpIngress(engine)
    await ingress.open(TransportSpec(transport="http", session_id="relay-begins", timeout_s=10))
    begin = _RelaySender.begin

    def slow_begin(self, manifest):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        begin(self, manifest)

    monkeypatch.setattr(_RelaySender, "begin", slow_begin)
    try:
        new = perturbed(original, seed=5)
        manifest = plan_manifest(specs_of(list(new.items())), version=1, bucket_bytes=1 << 16, transport="http")
        buckets = {b.index: pack_bucket(manifest, b.index, new, alloc_bucket(b.nbytes)) for b in manifest.buckets}
        assert len(buckets) > 1
        assert await asyncio.wait_for(ingress.push(manifest, buckets.__getitem__), 30) == 1
        assert engine.weight_version == 1
    finally:
        await ingress.close()
        await engine.close()
