"""An SGLang engine serving the FP8 block copy of a BF16 checkpoint (option
``weight_quantization="fp8_block"``), over FakeSglangRuntime (SGLang needs CUDA; see the fake's
docstring): the checks and conversions that happen before SGLang loads anything. What SGLang does
with the tensors is tested on a GPU (``test_gpu_sglang_fp8.py``).

Relayed pushes in BF16 are quantized by the engine's relay into the checkpoint's form; the trainer's
own quantization (``quantize="fp8_block"``) lands the same bits; an FP8 push without a weight's
scales, or a BF16 push over a transport SGLang loads as sent (``disk``), is refused with nothing
applied and the session stays usable.
"""

from __future__ import annotations

import pytest
import torch
from rollout_engines.errors import ManifestMismatch
from rollout_engines.types import EngineConfig
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.fp8 import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    fp8_block_checkpoint_cached,
    quantize_fp8_block,
    quantize_named,
    read_block_config,
)
from rollout_engines.weights.session import connect_weight_sync
from rollout_engines_sglang.engine import SglangEngine, SglangOptions, server_kwargs
from sglang_fake import FakeSglangRuntime

QPROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def fp8_engine(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_ENGINES_CACHE", str(tmp_path / "cache"))
    served = fp8_block_checkpoint_cached(tiny_model)
    fake = FakeSglangRuntime(tiny_model)
    fake.weights = load_checkpoint(served)  # as stored: float8_e4m3fn weights and float32 scales
    config = EngineConfig(backend="sglang", model=str(tiny_model), dtype="float32",
                          options={"relay_device": "cpu", "weight_quantization": "fp8_block"})
    return SglangEngine(config, runtime=fake), fake


def trainer_weights(tiny_model) -> dict[str, torch.Tensor]:
    return perturbed(load_checkpoint(tiny_model, dtype=torch.float32), seed=21)


async def push(engine, tensors, version, transport="inproc", **kw):
    options = kw.pop("options", None)
    sync = await connect_weight_sync([engine], transport, **({"options": options} if options else {}))
    try:
        return await sync.push(tensors, version=version, **kw)
    finally:
        await sync.close()


async def fingerprint(engine) -> str:
    return (await engine.diagnostics(fingerprint=True)).weights_fingerprint


def test_the_engine_serves_the_fp8_copy(tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ROLLOUT_ENGINES_CACHE", str(tmp_path / "cache"))
    config = EngineConfig(backend="sglang", model=str(tiny_model), dtype="bfloat16",
                          options={"weight_quantization": "fp8_block"})
    opts = SglangOptions.model_validate(config.options)
    from rollout_engines.weights.fp8 import served_checkpoint

    served = served_checkpoint(config.model, opts.weight_quantization)
    assert read_block_config(served) == (128, 128)  # SGLang reads its quantization_config
    kw = server_kwargs(config, opts, served)
    assert kw["model_path"] == served and kw["tokenizer_path"] == str(tiny_model)
    assert server_kwargs(config, opts)["model_path"] == str(tiny_model)
    with pytest.raises(ValueError, match="fp8_block"):
        SglangOptions.model_validate({"weight_quantization": "int4"})


async def test_bf16_push_is_quantized_by_the_relay_like_the_trainers_quantizer(fp8_engine, tiny_model) -> None:
    engine, fake = fp8_engine
    new = trainer_weights(tiny_model)
    start = await fingerprint(engine)
    assert await push(engine, new, version=1) == 1
    q, s = quantize_fp8_block(new[QPROJ])
    assert fake.weights[QPROJ].dtype == FP8_DTYPE
    assert torch.equal(fake.weights[QPROJ].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fake.weights[QPROJ + SCALE_SUFFIX], s)
    assert torch.equal(fake.weights["model.norm.weight"], new["model.norm.weight"])  # not quantized
    after_bf16 = await fingerprint(engine)
    assert after_bf16 != start

    # The same weights quantized by the trainer: the same bits, the version moves on.
    assert await push(engine, load_checkpoint(tiny_model, dtype=torch.float32), version=2) == 2
    assert await fingerprint(engine) != after_bf16
    assert await push(engine, new, version=3, quantize="fp8_block") == 3
    assert await fingerprint(engine) == after_bf16
    assert engine.weight_version == 3


async def test_fp8_push_without_its_scales_is_refused_and_changes_nothing(fp8_engine, tiny_model) -> None:
    engine, fake = fp8_engine
    form = dict(quantize_named(trainer_weights(tiny_model).items()))
    del form[QPROJ + SCALE_SUFFIX]
    before = await fingerprint(engine)
    sync = await connect_weight_sync([engine], "inproc")
    try:
        with pytest.raises(ManifestMismatch, match="without its scales"):
            await sync.push(form, version=1, partial=True)
        assert await fingerprint(engine) == before and fake.tensor_updates == []
        assert engine.weight_version == 0
        # The session is still in step: the next push through it lands.
        assert await sync.push(trainer_weights(tiny_model), version=2) == 2
    finally:
        await sync.close()
    assert await fingerprint(engine) != before


async def test_bf16_push_over_disk_is_refused_an_fp8_push_loads(fp8_engine, tiny_model, tmp_path) -> None:
    engine, fake = fp8_engine
    new = trainer_weights(tiny_model)
    before = await fingerprint(engine)
    options = {"path": str(tmp_path / "updates")}
    with pytest.raises(ManifestMismatch, match="quantize='fp8_block'"):
        await push(engine, new, version=1, transport="disk", options=options)
    assert fake.disk_updates == [] and await fingerprint(engine) == before
    assert await push(engine, new, version=2, transport="disk", options=options, quantize="fp8_block") == 2
    (path,) = fake.disk_updates
    q, _ = quantize_fp8_block(new[QPROJ])
    assert torch.equal(fake.weights[QPROJ].view(torch.uint8), q.view(torch.uint8))
