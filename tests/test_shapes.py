"""`rollout_engines.testing.shapes`: random-init checkpoints of real shapes load and generate."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from rollout_engines import create_engine
from rollout_engines.testing import shapes
from rollout_engines.testing.shapes import INDEX_FILE, build_shape, tensor_shapes
from rollout_engines.types import GenerateRequest, SamplingParams

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(300)]


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path))


def test_tiny_shape_sharded_loads_and_generates(tmp_path, monkeypatch):
    monkeypatch.setattr(shapes, "SHARD_BYTES", 200_000)  # several shards, to exercise the index
    path = build_shape("tiny", tmp_path / "tiny", dtype="float32")
    index = json.loads((path / INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((path / f).is_file() for f in files)
    assert set(index["weight_map"]) == {n for n, _ in tensor_shapes(shapes.SHAPES["tiny"])}
    model = _load(path)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == 4096
    state = model.state_dict()
    assert state["model.layers.0.self_attn.q_norm.weight"].mean().item() == pytest.approx(1.0, abs=0.1)

    async def generate():
        engine = create_engine("transformers", model=str(path))
        try:
            request = GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]],
                                      sampling=SamplingParams(temperature=0, max_tokens=6))
            return await engine.generate(request)
        finally:
            await engine.close()

    (first,) = asyncio.run(generate())
    assert len(first.token_ids) == 6 and all(0 <= t < 4096 for t in first.token_ids)


def test_qwen3_06b_width_two_layers(tmp_path):
    path = build_shape("qwen3-0.6b", tmp_path / "q", layers=2, seed=3)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 151936 and config["hidden_size"] == 1024 and config["num_hidden_layers"] == 2
    model = _load(path)
    assert model.dtype == torch.bfloat16
    assert model.get_input_embeddings().weight.shape == (151936, 1024)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # tied
    out = model.generate(torch.tensor([[11, 12, 13, 14]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_unknown_shape_and_nonempty_folder(tmp_path):
    with pytest.raises(ValueError, match="known"):
        build_shape("nope", tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        build_shape("tiny", tmp_path / "b")


def test_moe_shape_stores_experts_as_qwen3_moe_checkpoints_do(tmp_path):
    """A mixture-of-experts shape: per-expert tensors under Qwen3-MoE checkpoint names, which
    transformers loads (fusing the experts) with nothing missing or left over and every expert's
    values where they belong; the model generates."""
    from safetensors.torch import load_file

    path = build_shape("tiny-moe", tmp_path / "moe", dtype="float32")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 8 and config["num_experts_per_tok"] == 2
    names = [n for n, _ in tensor_shapes(shapes.SHAPES["tiny-moe"])]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert not any(n.endswith("mlp.gate_proj.weight") for n in names)  # no dense MLP
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stored: dict[str, torch.Tensor] = {}
    for f in set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()):
        stored.update(load_file(str(path / f)))
    assert set(stored) == set(names)
    loaded = {n: p.detach() for n, p in model.named_parameters()}
    prefix = "model.layers.1.mlp."
    for e in (0, 5):
        gate, up, down = (stored[f"{prefix}experts.{e}.{k}_proj.weight"] for k in ("gate", "up", "down"))
        if prefix + "experts.gate_up_proj" in loaded:  # transformers 5: experts fused per layer
            assert torch.equal(loaded[prefix + "experts.gate_up_proj"][e], torch.cat([gate, up]))
            assert torch.equal(loaded[prefix + "experts.down_proj"][e], down)
        else:
            assert torch.equal(loaded[f"{prefix}experts.{e}.gate_proj.weight"], gate)
            assert torch.equal(loaded[f"{prefix}experts.{e}.down_proj.weight"], down)
    out = model.generate(torch.tensor([[11, 12, 13, 14]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_qwen3_30b_a3b_shape_is_the_real_models_size():
    """Qwen3-30B-A3B: 30.5 B parameters over 48 layers of 128 experts (the model card's figures)."""
    import math

    tensors = tensor_shapes(shapes.SHAPES["qwen3-30b-a3b"])
    params = sum(math.prod(dims) for _, dims in tensors)
    assert 30.4e9 < params < 30.6e9
    assert sum(1 for n, _ in tensors if ".mlp.experts." in n) == 48 * 128 * 3
