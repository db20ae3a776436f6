"""Option ``pack_weights``: its load format reaches vLLM's workers and loads the model there (on the
CPU, with nothing to pack, exactly as vLLM's default loader), its size estimate of a checkpoint's
weights, and what it refuses. The packing itself needs CUDA sleep mode (test_gpu_vllm.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from rollout_engines import GenerateRequest, SamplingParams, create_engine
from safetensors.torch import save_file
from test_engine_args import args_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

GREEDY = GenerateRequest(prompt_token_ids=[[5, 6, 7, 8], [40, 41, 42]],
                         sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))


def _checkpoint(path, *, tied: bool, lm_head: bool):
    """A checkpoint of one 4 MiB bf16 embedding, maybe an LM head, and a small norm."""
    path.mkdir()
    tensors = {"model.embed_tokens.weight": torch.zeros(4096, 512, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(512, dtype=torch.bfloat16)}
    if lm_head:
        tensors["lm_head.weight"] = torch.zeros(4096, 512, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return path


@pytest.mark.parametrize(("tied", "lm_head", "dtype", "expected_mib"), [
    (False, True, torch.bfloat16, 8),   # embedding + head; the 1 KiB norm comes from the small-block pool
    (True, True, torch.bfloat16, 4),    # a tied head stored anyway: vLLM skips it, so is it here
    (True, False, torch.bfloat16, 4),
    (False, True, torch.float32, 16),   # floating tensors take the model's dtype
])
def test_weight_bytes_count_what_the_model_will_allocate_in_large_blocks(tmp_path, tied, lm_head, dtype, expected_mib):
    from rollout_engines_vllm.packed_loader import SEGMENT_ROUND, reservation_bytes, weight_bytes

    model = _checkpoint(tmp_path / "m", tied=tied, lm_head=lm_head)
    assert weight_bytes(model, dtype) == expected_mib << 20
    reserved = reservation_bytes(model, dtype)
    assert reserved % SEGMENT_ROUND == 0 and reserved < expected_mib << 20  # a little short, never above


def test_weight_bytes_of_the_tiny_model_match_its_large_parameters(tiny_model):
    """Against the parameters transformers builds from the same checkpoint (a tied head once)."""
    from rollout_engines_vllm.packed_loader import SMALL_TENSOR, weight_bytes
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    large = sum(p.nbytes for p in model.parameters() if p.nbytes > SMALL_TENSOR)
    assert large > 0 and weight_bytes(tiny_model, torch.float32) == large


def test_option_selects_the_load_format_and_refuses_what_it_cannot_pack(tiny_model):
    from rollout_engines_vllm.packed_loader import LOAD_FORMAT

    assert args_for(str(tiny_model), platform="cuda", options={"pack_weights": True}).load_format == LOAD_FORMAT
    assert args_for(str(tiny_model), platform="cuda").load_format == "auto"
    with pytest.raises(ValueError, match="not load_format='dummy': drop one of the two"):
        args_for(str(tiny_model), options={"pack_weights": True, "load_format": "dummy"})
    with pytest.raises(ValueError, match="does not go with weight_quantization"):
        args_for(str(tiny_model), options={"pack_weights": True, "weight_quantization": "fp8_block"})


def test_engine_loads_through_the_packed_format_and_answers_as_the_default_loader(tiny_model):
    async def answers(**options):
        engine = await asyncio.to_thread(create_engine, "vllm", str(tiny_model), dtype="float32", **options)
        try:
            return [c.token_ids for c in await engine.generate(GREEDY)], (await engine.info()).extra["workers"]
        finally:
            await engine.close()

    packed, workers = asyncio.run(answers(pack_weights=True))
    plain, plain_workers = asyncio.run(answers())
    assert packed == plain and all(len(t) == 8 for t in packed)
    # the workers loaded through this plugin's loader (which had nothing to pack on the CPU)
    assert [w.get("packed_weights_reserved_bytes") for w in workers] == [0]
    assert "packed_weights_reserved_bytes" not in plain_workers[0]
