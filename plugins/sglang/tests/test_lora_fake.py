"""LoRA adapters on SglangEngine over the fake runtime (SGLang needs CUDA; see sglang_fake.py): what
SGLang is asked (load from tensors, per-rank payloads, ``lora_path`` per sequence, unload of
retired versions once unused) and what comes back (``Completion.lora`` / ``lora_version``)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_engines.errors import InvalidRequest, ManifestMismatch, WeightSyncError
from rollout_engines.testing.conformance import make_lora
from rollout_engines.types import EngineConfig, GenerateRequest, SamplingParams
from rollout_engines.weights.checkpoint import load_checkpoint
from rollout_engines.weights.session import connect_weight_sync
from rollout_engines_sglang.engine import SglangEngine, SglangOptions, server_kwargs
from sglang_fake import FakeSglangRuntime, StreamingFakeSglangRuntime

REQUEST = GenerateRequest(prompt_token_ids=[[5, 6, 7], [9]], sampling=SamplingParams(temperature=0.0, max_tokens=4))


def make(tiny_model, *, tp_size: int = 1, step_s: float = 0.002, **options) -> tuple[SglangEngine, StreamingFakeSglangRuntime]:
    fake = StreamingFakeSglangRuntime(tiny_model, tp_size=tp_size, step_s=step_s)
    config = EngineConfig(backend="sglang", model=str(tiny_model), dtype="float32", tensor_parallel_size=tp_size,
                          options={"relay_device": "cpu", "enable_lora": True, **options})
    return SglangEngine(config, runtime=fake), fake


@pytest.fixture(scope="module")
def weights(tiny_model) -> dict[str, torch.Tensor]:
    return load_checkpoint(tiny_model, dtype=torch.float32)


async def push_lora(engine, spec, tensors, version, transport="inproc", **kw) -> int:
    sync = await connect_weight_sync([engine], transport, timeout_s=30, **kw)
    try:
        return await sync.push_lora(spec, tensors, version=version)
    finally:
        await sync.close()


def lora(request: GenerateRequest, name: str | None, **update) -> GenerateRequest:
    sampling = request.sampling.model_copy(update=update) if update else request.sampling
    return request.model_copy(update={"lora": name, "sampling": sampling})


def caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def test_options_map_to_sglang_server_args(tiny_model) -> None:
    config = EngineConfig(backend="sglang", model=str(tiny_model))
    assert "enable_lora" not in server_kwargs(config, SglangOptions())
    kw = server_kwargs(config, SglangOptions(enable_lora=True, max_lora_rank=32, max_loras=3,
                                             lora_target_modules=["q_proj", "v_proj"]))
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["lora_target_modules"]) == (True, 32, ["q_proj", "v_proj"])
    assert kw["max_loras_per_batch"] == 7  # 3 adapters, a retiring version of each, the base model
    with pytest.raises(ValueError, match="linear layers only"):
        SglangOptions(enable_lora=True, lora_target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="max_loaded_loras"):
        server_kwargs(config, SglangOptions(enable_lora=True, max_loaded_loras=4))


def test_capabilities_only_when_enabled(tiny_model) -> None:
    off, _ = make(tiny_model, enable_lora=False)
    assert (off.capabilities.lora, off.capabilities.max_loras) == (0, 0)
    on, _ = make(tiny_model, max_lora_rank=32, max_loras=3)
    assert (on.capabilities.lora, on.capabilities.max_loras) == (32, 3)


@pytest.mark.parametrize("transport", ["inproc", "disk"])
async def test_push_loads_from_tensors_and_requests_name_the_version(tiny_model, weights, transport, tmp_path) -> None:
    engine, fake = make(tiny_model, tp_size=2)
    base = await engine.generate(REQUEST)
    spec, tensors = make_lora(weights, "x", seed=1)
    kw = {"options": {"path": str(tmp_path)}} if transport == "disk" else {}
    assert await push_lora(engine, spec, tensors, 1, transport, **kw) == 1
    assert engine.loras == {"x": 1} and fake.lora_calls == [("load", "x@v1#1")]
    loaded = fake.loras["x@v1#1"]
    assert (loaded["config"]["r"], loaded["config"]["lora_alpha"]) == (spec.rank, spec.alpha)
    assert loaded["config"]["target_modules"] == spec.target_modules
    assert loaded["tensors"].keys() == tensors.keys()
    assert all(torch.equal(loaded["tensors"][n], t) for n, t in tensors.items())
    outs = await engine.generate(lora(REQUEST, "x"))
    assert fake.generate_calls[-1]["lora_path"] == ["x@v1#1", "x@v1#1"]
    assert [c.token_ids for c in outs] != [c.token_ids for c in base]
    assert all(c.lora == "x" and c.lora_version == 1 for c in outs)
    again = await engine.generate(REQUEST)
    assert "lora_path" not in fake.generate_calls[-1] and all(c.lora is None for c in again)
    assert [c.token_ids for c in again] == [c.token_ids for c in base]
    assert engine.weight_version == 0


async def test_runtime_without_streaming_sends_lora_path_too(tiny_model, weights) -> None:
    fake = FakeSglangRuntime(tiny_model)
    engine = SglangEngine(EngineConfig(backend="sglang", model=str(tiny_model), dtype="float32",
                                       options={"relay_device": "cpu", "enable_lora": True}), runtime=fake)
    spec, tensors = make_lora(weights, "x", seed=1)
    await push_lora(engine, spec, tensors, 1)
    outs = await engine.generate(lora(REQUEST, "x"))
    assert fake.generate_calls[-1]["lora_path"] == ["x@v1#1", "x@v1#1"]
    assert all(c.lora == "x" and c.lora_version == 1 for c in outs)


async def test_stream_deltas_name_the_adapter(tiny_model, weights) -> None:
    engine, _ = make(tiny_model)
    spec, tensors = make_lora(weights, "x", seed=1)
    await push_lora(engine, spec, tensors, 3)
    request = lora(REQUEST, "x").model_copy(update={"request_ids": ["a", "b"]})
    deltas = [d async for d in engine.stream(request)]
    assert deltas and all(d.lora == "x" and d.lora_version == 3 for d in deltas)


async def test_new_version_replaces_and_the_old_is_unloaded(tiny_model, weights) -> None:
    engine, fake = make(tiny_model)
    spec, v1 = make_lora(weights, "x", seed=1)
    _, v2 = make_lora(weights, "x", seed=2)
    await push_lora(engine, spec, v1, 1)
    first = await engine.generate(lora(REQUEST, "x"))
    await push_lora(engine, spec, v2, 2)
    assert fake.lora_calls == [("load", "x@v1#1"), ("load", "x@v2#2"), ("unload", "x@v1#1")]
    assert set(fake.loras) == {"x@v2#2"}
    second = await engine.generate(lora(REQUEST, "x"))
    assert fake.generate_calls[-1]["lora_path"][0] == "x@v2#2"
    assert [c.token_ids for c in second] != [c.token_ids for c in first]
    assert all(c.lora_version == 2 for c in second)


async def test_request_in_flight_keeps_its_version_until_it_ends(tiny_model, weights) -> None:
    engine, fake = make(tiny_model, step_s=0.01)
    spec, v1 = make_lora(weights, "x", seed=1)
    _, v2 = make_lora(weights, "x", seed=2)
    await push_lora(engine, spec, v1, 1)
    long = lora(REQUEST, "x", max_tokens=40)
    running = asyncio.ensure_future(engine.generate(long))
    while not fake.lora_users:
        await asyncio.sleep(0.001)
    await push_lora(engine, spec, v2, 2)
    assert set(fake.loras) == {"x@v1#1", "x@v2#2"}  # version 1 still runs
    newer = await engine.generate(lora(REQUEST, "x"))
    assert all(c.lora_version == 2 for c in newer)
    outs = await running
    assert all(c.lora_version == 1 for c in outs)
    for _ in range(100):  # its release unloads version 1 in the background
        if "x@v1#1" not in fake.loras:
            break
        await asyncio.sleep(0.01)
    assert set(fake.loras) == {"x@v2#2"} and fake.lora_calls[-1] == ("unload", "x@v1#1")


async def test_refused_by_sglang_keeps_the_previous_version(tiny_model, weights) -> None:
    engine, fake = make(tiny_model)
    spec, v1 = make_lora(weights, "x", seed=1)
    _, v2 = make_lora(weights, "x", seed=2)
    await push_lora(engine, spec, v1, 1)
    before = await engine.generate(lora(REQUEST, "x"))
    fake.refuse_lora = "LoRA adapter x@v2#2 with rank 8 is incompatible with the current LoRA memory pool"
    with pytest.raises(WeightSyncError) as info:
        await push_lora(engine, spec, v2, 2)
    assert caused_by(info.value, ManifestMismatch) and "incompatible" in str(info.value)
    assert engine.loras == {"x": 1} and set(fake.loras) == {"x@v1#1"}
    after = await engine.generate(lora(REQUEST, "x"))
    assert [c.token_ids for c in after] == [c.token_ids for c in before] and after[0].lora_version == 1
    assert await push_lora(engine, spec, v2, 2) == 2  # the session is still in step


async def test_target_outside_lora_target_modules_is_refused_before_receiving(tiny_model, weights) -> None:
    engine, fake = make(tiny_model, lora_target_modules=["q_proj"])  # SGLang's qkv_proj: q, k and v
    spec, tensors = make_lora(weights, "x", targets=["k_proj", "o_proj"])
    with pytest.raises(WeightSyncError) as info:
        await push_lora(engine, spec, tensors, 1)
    assert caused_by(info.value, ManifestMismatch) and "lora_target_modules" in str(info.value)
    assert fake.lora_calls == [] and engine.loras == {}
    ok, ok_tensors = make_lora(weights, "x", targets=["k_proj", "v_proj"])
    assert await push_lora(engine, ok, ok_tensors, 1) == 1


async def test_unload_and_unknown_adapters(tiny_model, weights) -> None:
    engine, fake = make(tiny_model)
    with pytest.raises(InvalidRequest, match="not loaded"):
        await engine.generate(lora(REQUEST, "x"))
    spec, tensors = make_lora(weights, "x", seed=1)
    await push_lora(engine, spec, tensors, 1)
    assert await engine.unload_lora("x") is True
    assert await engine.unload_lora("x") is False
    assert fake.lora_calls[-1] == ("unload", "x@v1#1") and fake.loras == {} and engine.loras == {}
    with pytest.raises(InvalidRequest, match="not loaded"):
        await engine.generate(lora(REQUEST, "x"))
    await push_lora(engine, spec, tensors, 1)  # loadable again, under a new SGLang name
    assert fake.lora_calls[-1] == ("load", "x@v1#2")
    await engine.close()
