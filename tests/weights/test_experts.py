"""Mixture-of-experts models under their checkpoint names (:mod:`rollout_engines.weights.experts`):
transformers 5 fuses a Qwen3-MoE layer's experts on load; a trainer hands them over per expert (as
vLLM and SGLang load them) with ``checkpoint_named``, and the embedded engine receives those names
into its fused parameters."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from rollout_engines import GenerateRequest, SamplingParams, create_engine
from rollout_engines.errors import ManifestMismatch
from rollout_engines.testing.shapes import INDEX_FILE, build_shape
from rollout_engines.weights.experts import checkpoint_named, expert_aliases
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(300)]
pytest.importorskip("transformers.core_model_loading", reason="transformers < 5 keeps each expert's own parameters")

PROMPT = [[11, 12, 13, 14]]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build_shape("tiny-moe", tmp_path_factory.mktemp("moe") / "m", dtype="float32")


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _greedy(model) -> list[int]:
    out = model.generate(torch.tensor(PROMPT), max_new_tokens=8, do_sample=False)
    return out[0, len(PROMPT[0]):].tolist()


def test_checkpoint_named_gives_the_checkpoint_as_views_of_the_fused_parameters(moe_path):
    from safetensors.torch import load_file

    model = _hf(moe_path)
    named = checkpoint_named(model)
    stored: dict[str, torch.Tensor] = {}
    for f in set(json.loads((moe_path / INDEX_FILE).read_text())["weight_map"].values()):
        stored.update(load_file(str(moe_path / f)))
    assert set(named) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(named[name], tensor), name
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    up = named["model.layers.1.mlp.experts.6.up_proj.weight"]
    assert up.is_contiguous() and up.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    with torch.no_grad():
        fused.mul_(2)  # the trainer's step, in place: the views see it
    assert torch.equal(up, stored["model.layers.1.mlp.experts.6.up_proj.weight"] * 2)
    again = checkpoint_named(model)  # the same objects (a zero-copy push reuses its descriptions)
    assert all(again[n] is named[n] for n in named)
    fused.data = fused.data.clone()  # moved (e.g. re-sharded): new views of the new memory
    moved = checkpoint_named(model)
    assert moved["model.layers.1.mlp.experts.6.up_proj.weight"] is not up
    assert moved["model.layers.1.mlp.experts.6.up_proj.weight"].data_ptr() != up.data_ptr()
    assert moved["model.layers.0.mlp.experts.6.up_proj.weight"] is named["model.layers.0.mlp.experts.6.up_proj.weight"]


def test_a_dense_model_keeps_its_state_dict_names(tiny_model):
    model = _hf(tiny_model)
    assert expert_aliases(model) is None
    assert list(checkpoint_named(model)) == list(model.state_dict())


def test_a_plain_torch_model_is_received_without_importing_transformers():
    """A receiver's first push reads its target's specs, which look for fused experts: a module
    that is not a transformers model must not pay transformers' import (~1 s, first push only)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from rollout_engines.weights.receiver import StateDictTarget\n"
        "specs = StateDictTarget(torch.nn.Linear(3, 2)).expected_specs()\n"
        "assert sorted(specs) == ['bias', 'weight'], sorted(specs)\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_a_transformers_trainer_pushes_its_moe_model_into_the_embedded_engine(moe_path):
    """The trainer holds the model in transformers 5 (fused experts), changes it, pushes it under
    the checkpoint's names; the engine then answers as the trainer's model does, also after a
    delta push of a few changed expert elements. Its fused state dict is refused with a hint."""
    trainer = _hf(moe_path)
    start = _greedy(trainer)
    request = GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(temperature=0, max_tokens=8))

    async def run() -> tuple[list[int], list[int], list[int], ManifestMismatch]:
        engine = create_engine("transformers", model=str(moe_path), dtype="float32")
        try:
            before = (await engine.generate(request))[0].token_ids
            sync = await connect_weight_sync([engine], "shm", timeout_s=60, delta=True)
            try:
                with torch.no_grad():
                    g = torch.Generator().manual_seed(3)
                    for p in trainer.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.3)
                await sync.push(checkpoint_named(trainer), version=1)
                full = sync.last_push_bytes
                pushed = (await engine.generate(request))[0].token_ids
                with torch.no_grad():
                    trainer.model.layers[0].mlp.experts.down_proj[5, :3, :7].add_(4.0)  # a few elements
                await sync.push(checkpoint_named(trainer), version=2)
                assert sync.last_push_bytes < full / 20  # one expert's few elements, sparse
                delta = (await engine.generate(request))[0].token_ids
                with pytest.raises(ManifestMismatch) as refused:
                    await sync.push(trainer.state_dict(), version=3, delta=False)
            finally:
                await sync.close()
            return before, pushed, delta, refused.value
        finally:
            await engine.close()

    before, pushed, delta, refused = asyncio.run(run())
    assert before == start
    with torch.no_grad():
        trainer.model.layers[0].mlp.experts.down_proj[5, :3, :7].sub_(4.0)
    expected_pushed = _greedy(trainer)
    with torch.no_grad():
        trainer.model.layers[0].mlp.experts.down_proj[5, :3, :7].add_(4.0)
    assert pushed == expected_pushed != start
    assert delta == _greedy(trainer)
    assert "checkpoint_named" in str(refused) and "gate_up_proj" in str(refused)
