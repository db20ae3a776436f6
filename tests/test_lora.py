"""LoRA adapters on the embedded engine: pushed through real weight-sync sessions (inproc, shm,
gloo, disk), applied per row by the engine's own hooks, checked against the same adapter merged
into the base weights, in PEFT's file format, behind an :class:`EngineGroup`.

The conformance suite's LoRA tests (``LoraTests``) run through ``test_conformance_transformers.py``;
this file covers what they do not: the transports, the maths, mixing and replacing adapters while
requests run, the limits, and the receiver's base state.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import rollout_engines as roe
import torch
from rollout_engines import CapabilityError, InvalidRequest, LoraSpec, ManifestMismatch, WeightSyncError
from rollout_engines.testing.conformance import make_lora
from rollout_engines.weights.checkpoint import load_checkpoint
from rollout_engines.weights.lora import PEFT_PREFIX, load_peft_adapter, save_peft_adapter

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(300)]

PROMPTS = [[11, 12, 13, 14], [200, 300, 400], [7, 8]]


def request(lora: str | None = None, max_tokens: int = 8, **kw: Any) -> roe.GenerateRequest:
    return roe.GenerateRequest(prompt_token_ids=PROMPTS, lora=lora, sampling=roe.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw))


def tokens(outs: list[roe.Completion]) -> list[list[int]]:
    return [c.token_ids for c in outs]


@pytest.fixture(scope="module")
def original(tiny_model: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(str(tiny_model), torch.float32)


@pytest.fixture
async def engine(tiny_model: Path) -> AsyncIterator[Any]:
    e = roe.create_engine("transformers", model=str(tiny_model), dtype="float32")
    yield e
    await e.close()


async def push_lora(engine: Any, spec: LoraSpec, tensors: dict[str, torch.Tensor], version: int,
                    transport: str = "inproc", **kw: Any) -> int:
    async with await roe.connect_weight_sync([engine], transport=transport, timeout_s=60, **kw) as sync:
        return await sync.push_lora(spec, tensors, version=version)


def merged(original: dict[str, torch.Tensor], spec: LoraSpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base weights with the adapter folded in: ``W + scaling * B @ A`` (what PEFT's
    ``merge_and_unload`` computes)."""
    out = dict(original)
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        module = name[len(PEFT_PREFIX): -len(".lora_A.weight")]
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        out[f"{module}.weight"] = original[f"{module}.weight"] + spec.scaling * (b.double() @ a.double()).float()
    return out


# ---- the maths ------------------------------------------------------------------------------------
async def test_adapter_outputs_match_the_adapter_merged_into_the_weights(engine, original):
    spec, tensors = make_lora(original, "merge-check", rank=4, seed=11, targets=["q_proj", "v_proj", "down_proj"])
    await push_lora(engine, spec, tensors, 1)
    adapted = await engine.generate(request("merge-check", logprobs=0))
    async with await roe.connect_weight_sync([engine], transport="inproc") as sync:
        await sync.push(merged(original, spec, tensors), version=1)
        folded = await engine.generate(request(logprobs=0))
        await sync.push(original, version=2)
    assert tokens(adapted) == tokens(folded)
    for a, f in zip(adapted, folded, strict=True):
        assert a.lora == "merge-check" and f.lora is None
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(f.logprobs), atol=1e-4)


@pytest.mark.parametrize("transport", ["inproc", "shm", "gloo", "disk"])
async def test_every_cpu_transport_carries_an_adapter(engine, original, transport, tmp_path):
    base = tokens(await engine.generate(request()))
    spec, tensors = make_lora(original, "over-" + transport, seed=3)
    options = {"options": {"path": str(tmp_path)}} if transport == "disk" else {}
    await push_lora(engine, spec, tensors, 7, transport, bucket_bytes=16 * 1024, **options)  # several buckets
    outs = await engine.generate(request(spec.name))
    assert tokens(outs) != base and {(c.lora, c.lora_version) for c in outs} == {(spec.name, 7)}
    assert await engine.unload_lora(spec.name) is True
    assert tokens(await engine.generate(request())) == base


async def test_a_lora_push_leaves_the_base_delta_record_alone(engine, original):
    """A delta push of the base after a LoRA push is still a delta (the receiver's record of the
    base weights was not disturbed), and it applies."""
    spec, tensors = make_lora(original, "side", seed=5)
    changed = dict(original)
    name = "model.layers.0.mlp.up_proj.weight"
    changed[name] = original[name] + 0.5
    async with await roe.connect_weight_sync([engine], transport="inproc", delta=True) as sync:
        await sync.push(original, version=1)
        await sync.push_lora(spec, tensors, version=1)
        await sync.push(changed, version=2)
        assert sync.last_push_bytes < sync.last_push_model_bytes / 4, "the base push after the adapter was not a delta"
        after = tokens(await engine.generate(request()))
        await sync.push(original, version=3)
    reference = roe.create_engine("transformers", model=str(engine.config.model), dtype="float32")
    try:
        async with await roe.connect_weight_sync([reference], transport="inproc") as sync:
            await sync.push(changed, version=2)
        assert after == tokens(await reference.generate(request()))
    finally:
        await reference.close()


async def test_pushes_of_the_same_tensors_reuse_the_planned_layout(engine, original, monkeypatch):
    """A session plans (lays out and validates) a manifest once per set of tensors: the next LoRA
    push of tensors with the same names, dtypes and shapes reuses the layout with its own version
    and adapter (here a new alpha, which the outputs show), and a full push gets its own."""
    from rollout_engines.weights import session as session_module

    planned: list[str] = []
    real = session_module.plan_manifest

    def counting(*args: Any, **kwargs: Any) -> Any:
        planned.append("lora" if kwargs.get("lora") is not None else "full")
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "plan_manifest", counting)
    spec, tensors = make_lora(original, "same-shape", rank=4, seed=21)
    louder = spec.model_copy(update={"alpha": spec.alpha * 4})
    async with await roe.connect_weight_sync([engine], transport="inproc") as sync:
        await sync.push_lora(spec, tensors, version=1)
        first = tokens(await engine.generate(request(spec.name)))
        await sync.push_lora(louder, tensors, version=2)
        second = await engine.generate(request(spec.name))
        assert planned == ["lora"]  # the second push reused the first one's layout
        assert {c.lora_version for c in second} == {2} and tokens(second) != first  # ... with its own spec
        await sync.push(original, version=1)
        await sync.push(original, version=2)
        assert planned == ["lora", "full"]
    assert tokens(await engine.generate(request(spec.name))) == tokens(second)  # base pushes keep the adapter


# ---- batching: adapters per row ------------------------------------------------------------------
async def test_one_batch_mixes_adapters_and_the_base_row_by_row(engine, original):
    for version, (name, seed) in enumerate((("mix-a", 1), ("mix-b", 2)), start=1):
        spec, tensors = make_lora(original, name, seed=seed)
        await push_lora(engine, spec, tensors, version)
    names = [None, "mix-a", "mix-b"]
    alone = {n: await engine.generate(request(n, logprobs=0)) for n in names}
    forwards: list[set[str | None]] = []  # the adapters of every forward that used one
    rows = engine._lora.rows
    engine._lora.rows = lambda adapters: (forwards.append({a and a.name for a in adapters}), rows(adapters))[1]
    # The worker is held by a job of our own while every request is queued: it then takes them all
    # at once (one prefill, one running batch).
    gate = threading.Event()
    held = asyncio.ensure_future(engine._call(gate.wait))
    order = ["mix-b", None, "mix-a", "mix-a", None, "mix-b"]
    pending = [asyncio.ensure_future(engine.generate(request(n, logprobs=0))) for n in order]
    while len(engine._jobs) < len(order):
        await asyncio.sleep(0.01)
    batches = engine.batches_run
    gate.set()
    await held
    together = await asyncio.gather(*pending)
    assert engine.batches_run == batches + 1, "the requests were not prefilled together"
    assert forwards and all(f == {None, "mix-a", "mix-b"} for f in forwards)
    for n, outs in zip(order, together, strict=True):
        assert tokens(outs) == tokens(alone[n]), f"request with lora={n} changed when batched with others"
        for c, ref in zip(outs, alone[n], strict=True):
            assert c.lora == n and torch.allclose(torch.tensor(c.logprobs), torch.tensor(ref.logprobs), atol=1e-5)


async def test_a_running_request_keeps_its_adapter_version(engine, original):
    spec, v1 = make_lora(original, "swap", seed=1)
    _, v2 = make_lora(original, "swap", seed=2)
    await push_lora(engine, spec, v1, 1)
    first = tokens(await engine.generate(request("swap", max_tokens=40)))
    stream = engine.stream(request("swap", max_tokens=40))
    got: dict[str, list[int]] = {}
    delta = await anext(stream)
    got.setdefault(delta.request_id, []).extend(delta.token_ids)
    await push_lora(engine, spec, v2, 2)  # replaced while the stream's rows run
    assert await engine.unload_lora("swap") is True  # and then unloaded: the rows keep their version
    async for delta in stream:
        got.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert list(got.values()) == first
    with pytest.raises(InvalidRequest):
        await engine.generate(request("swap"))


async def test_hooks_go_once_no_adapter_is_left(engine, original):
    base = await engine.generate(request(logprobs=0))
    spec, tensors = make_lora(original, "hooks", seed=4)
    await push_lora(engine, spec, tensors, 1)
    await engine.generate(request("hooks"))
    linears = list(engine._lora.linears.values())
    assert any(m._forward_hooks for m in linears)
    await engine.unload_lora("hooks")
    again = await engine.generate(request(logprobs=0))
    assert not any(m._forward_hooks for m in linears)
    assert [c.logprobs for c in again] == [c.logprobs for c in base]  # bit for bit


# ---- limits -----------------------------------------------------------------------------------------
async def test_max_loras_and_max_lora_rank_options(tiny_model, original):
    e = roe.create_engine("transformers", model=str(tiny_model), dtype="float32", max_loras=2, max_lora_rank=8)
    try:
        assert (e.capabilities.lora, e.capabilities.max_loras) == (8, 2)
        for i in range(2):
            spec, tensors = make_lora(original, f"slot-{i}", seed=i)
            await push_lora(e, spec, tensors, 1)
        spec, tensors = make_lora(original, "slot-2", seed=9)
        with pytest.raises(ManifestMismatch, match="max_loras=2"):
            await push_lora(e, spec, tensors, 1)
        assert e.loras == {"slot-0": 1, "slot-1": 1}
        spec, tensors = make_lora(original, "slot-0", seed=9)  # a new version of a loaded one fits
        assert await push_lora(e, spec, tensors, 2) == 2
        spec, tensors = make_lora(original, "wide", rank=16, seed=9)
        await e.unload_lora("slot-1")
        with pytest.raises(ManifestMismatch, match="rank 16"):
            await push_lora(e, spec, tensors, 1)
        assert e.loras == {"slot-0": 2}
    finally:
        await e.close()
    off = roe.create_engine("transformers", model=str(tiny_model), max_lora_rank=0)
    try:
        assert off.capabilities.lora == 0 and off.capabilities.max_loras == 0
        spec, tensors = make_lora(original, "nope")
        with pytest.raises(CapabilityError):
            await push_lora(off, spec, tensors, 1)
        with pytest.raises(CapabilityError):
            await off.generate(request("nope"))
    finally:
        await off.close()


async def test_a_layer_that_is_not_linear_cannot_be_targeted(engine, original):
    spec, tensors = make_lora(original, "emb", seed=1)
    bad = spec.model_copy(update={"target_modules": ["embed_tokens"]})
    with pytest.raises(ManifestMismatch, match="lacks"):
        await push_lora(engine, bad, tensors, 1)
    assert engine.loras == {}


# ---- PEFT's format ------------------------------------------------------------------------------------
def save_peft(folder: Path, spec: LoraSpec, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    """What ``PeftModel.save_pretrained`` writes for a plain LoRA adapter (``config``: keys to change)."""
    return save_peft_adapter(folder, spec, tensors, config=config)


async def test_a_peft_adapter_round_trips(engine, original, tmp_path):
    spec, tensors = make_lora(original, "peft", rank=4, seed=21)
    # PEFT's names: the wrapped model's module path under base_model.model, then lora_A/lora_B.
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert tuple(tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape)[1] == 4
    folder = save_peft(tmp_path / "adapter", spec, tensors)
    loaded_spec, loaded = load_peft_adapter(folder, "from-disk")
    assert (loaded_spec.rank, loaded_spec.scaling, sorted(loaded_spec.target_modules)) == \
        (4, spec.scaling, sorted(spec.target_modules))
    await push_lora(engine, spec, tensors, 1)
    await push_lora(engine, loaded_spec, loaded, 1)
    assert tokens(await engine.generate(request("from-disk"))) == tokens(await engine.generate(request("peft")))
    # rsLoRA: PEFT scales by alpha / sqrt(r).
    rs_spec, _ = load_peft_adapter(save_peft(tmp_path / "rs", spec, tensors, use_rslora=True), "rs")
    assert rs_spec.scaling == pytest.approx(spec.alpha / spec.rank ** 0.5)
    for bad in ({"use_dora": True}, {"target_modules": "q_proj|v_proj"}, {"modules_to_save": ["lm_head"]}):
        with pytest.raises(ValueError, match="uses what LoRA pushes do not carry"):
            load_peft_adapter(save_peft(tmp_path / "bad", spec, tensors, **bad), "bad")


# ---- a group ----------------------------------------------------------------------------------------------
async def test_a_group_pushes_to_every_member_and_routes_to_holders(tiny_model, original):
    members = [roe.create_engine("transformers", model=str(tiny_model), dtype="float32", max_lora_rank=r)
               for r in (64, 16)]
    group = roe.EngineGroup(members, health_interval_s=None)
    try:
        assert group.capabilities.lora == 16 and group.capabilities.max_loras == 4
        base = tokens(await group.generate(request()))
        spec, tensors = make_lora(original, "grouped", seed=8)
        async with await roe.connect_weight_sync([group], transport="inproc") as sync:
            assert await sync.push_lora(spec, tensors, version=3) == 3
        assert group.loras == {"grouped": 3} and all(m.loras == {"grouped": 3} for m in members)
        assert (await group.info()).loras == {"grouped": 3}
        adapted = [tokens(await group.generate(request("grouped"))) for _ in range(4)]
        assert all(a == adapted[0] != base for a in adapted)
        # Member 1 loses it: requests naming it go to member 0 only.
        assert await members[1].unload_lora("grouped") is True
        done = [s["completed"] for s in group.member_stats()]
        for _ in range(4):
            assert tokens(await group.generate(request("grouped"))) == adapted[0]
        after = [s["completed"] for s in group.member_stats()]
        assert (after[0] - done[0], after[1] - done[1]) == (4, 0)
        assert await group.unload_lora("grouped") is True
        assert group.loras == {} and all(m.loras == {} for m in members)
        with pytest.raises(InvalidRequest):
            await group.generate(request("grouped"))
        assert tokens(await group.generate(request())) == base
        # A refused adapter is refused as such by every member.
        wide, wide_tensors = make_lora(original, "wide", rank=32, seed=1)
        with pytest.raises(WeightSyncError) as refused:
            async with await roe.connect_weight_sync([group], transport="inproc") as sync:
                await sync.push_lora(wide, wide_tensors, version=1)
        assert isinstance(refused.value, ManifestMismatch) and group.loras == {}
    finally:
        await group.close()
