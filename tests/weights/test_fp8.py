"""FP8 block quantization (rollout_engines.weights.fp8) on the CPU: error bound, shapes, names,
the FP8 checkpoint writer and sender-side quantization through a weight-sync push."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from rollout_engines.weights.fp8 import (
    FP8_MAX,
    QUANTIZATION_CONFIG,
    Fp8Forms,
    dequantize_fp8_block,
    fp8_block_checkpoint,
    fp8_block_checkpoint_cached,
    is_fp8_form,
    is_fp8_quantized,
    quantize_fp8_block,
    quantize_named,
    quantized_specs,
    read_block_config,
    spec_forms,
)
from rollout_engines.weights.manifest import TensorSpec, specs_of


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each element's block maximum, broadcast to ``w``'s shape."""
    n, k = w.shape
    bn, bk = block
    out = torch.empty_like(w, dtype=torch.float32)
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            blk = w[i:i + bn, j:j + bk].float()
            out[i:i + bn, j:j + bk] = blk.abs().max()
    return out


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (129, 1), (1, 257), (128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_within_the_e4m3_bound(shape, dtype):
    torch.manual_seed(0)
    # Blocks of very different magnitudes, as in real weights (and a row of outliers).
    w = (torch.randn(shape) * torch.logspace(-3, 1, shape[0])[:, None]).to(dtype)
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequantize_fp8_block(q, s)
    amax = _block_amax(w, (128, 128))
    err = (back - w.float()).abs()
    # 3 mantissa bits: half an ulp is 2^-4 relative for normal values; 2^-10 absolute (times the
    # block's scale amax/448) in the subnormal range. Float32 division adds a few 1e-7 relative.
    bound = w.float().abs() * 2**-4 + amax * 2**-10 / FP8_MAX
    assert bool((err <= bound * (1 + 1e-5) + 1e-30).all()), float((err - bound).max())
    assert bool((err <= amax / 16 + 1e-30).all())
    # The largest element of each block maps to ±448 exactly.
    assert float(q.float().abs().max()) == FP8_MAX


def _quantize_through_float32(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's arithmetic spelled out on a float32 copy: what quantize_fp8_block must equal."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    x = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    scale_inv = x.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (x / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale_inv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 257)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_same_bits_as_quantizing_a_float32_copy(dtype, shape, layout):
    """No float32 copy of the weights is made, and the bits are those of quantizing one: block
    maxima of bf16/fp16 are exact in their own dtype and the division promotes to float32."""
    torch.manual_seed(1)
    w = (torch.randn(shape) * torch.logspace(-6, 2, shape[0])[:, None]).to(dtype)
    w[0, :3] = torch.tensor([0.0, -0.0, 1e-30], dtype=torch.float64).to(dtype)  # zeros, an underflow
    if layout == "transposed":
        w = w.t().contiguous().t()  # the same values, column-major
    q, s = quantize_fp8_block(w)
    q_ref, s_ref = _quantize_through_float32(w)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_non_multiple_dims_use_the_elements_that_exist():
    w = torch.zeros(130, 130)
    w[129, 129] = 3.0  # alone in the edge block (1, 1)
    w[0, 0] = 1.0
    q, s = quantize_fp8_block(w)
    assert tuple(s.shape) == (2, 2)
    assert torch.allclose(s, torch.tensor([[1.0, 1e-12], [1e-12, 3.0]]) / FP8_MAX)
    assert float(q[129, 129].float()) == FP8_MAX


def test_zero_blocks_get_finite_scales_and_zero_weights():
    q, s = quantize_fp8_block(torch.zeros(256, 256, dtype=torch.bfloat16))
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())
    assert bool((q.float() == 0).all())
    assert bool((dequantize_fp8_block(q, s) == 0).all())


def test_other_block_sizes_and_bad_input():
    w = torch.randn(100, 70)
    q, s = quantize_fp8_block(w, block=(64, 32))
    assert tuple(s.shape) == (2, 3)
    assert (dequantize_fp8_block(q, s, block=(64, 32)) - w).abs().max() <= w.abs().max() / 16
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_block(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_fp8_block(q, s)


@pytest.mark.parametrize(("name", "shape", "quantized"), [
    ("model.layers.0.self_attn.q_proj.weight", (256, 128), True),
    ("model.layers.11.self_attn.k_proj.weight", (64, 128), True),
    ("model.layers.1.self_attn.v_proj.weight", None, True),
    ("model.layers.1.self_attn.o_proj.weight", (128, 256), True),
    ("model.layers.2.mlp.gate_proj.weight", (512, 128), True),
    ("model.layers.2.mlp.up_proj.weight", (512, 128), True),
    ("model.layers.2.mlp.down_proj.weight", (128, 512), True),
    ("model.language_model.layers.0.mlp.down_proj.weight", (128, 512), True),
    ("model.layers.0.self_attn.q_proj.bias", (256,), False),
    ("model.layers.0.self_attn.q_norm.weight", (128,), False),
    ("model.layers.0.input_layernorm.weight", (128,), False),
    ("model.layers.0.mlp.gate.weight", (8, 128), False),  # an MoE router
    ("model.embed_tokens.weight", (4096, 128), False),
    ("lm_head.weight", (4096, 128), False),
    ("model.norm.weight", (128,), False),
    ("model.layers.0.self_attn.q_proj.weight", (2, 2, 2), False),
])
def test_which_tensors_are_quantized(name, shape, quantized):
    assert is_fp8_quantized(name, shape) is quantized


def _named() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(1)
    return [
        ("model.embed_tokens.weight", torch.randn(300, 256, dtype=torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(256, 256, dtype=torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(256, dtype=torch.bfloat16)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(256, 200, dtype=torch.bfloat16)),
        ("model.norm.weight", torch.ones(256, dtype=torch.bfloat16)),
    ]


def test_quantize_named_and_its_specs_agree():
    named = _named()
    out = list(quantize_named(iter(named)))
    assert [n for n, _ in out] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv",
        "model.norm.weight",
    ]
    assert [s.model_dump() for s in specs_of(out)] == [s.model_dump() for s in quantized_specs(specs_of(named))]
    assert out[0][1] is named[0][1]  # untouched tensors pass through, not copied
    assert is_fp8_form(n for n, _ in out) and not is_fp8_form(n for n, _ in named)


def test_spec_forms_of_an_fp8_checkpoint():
    stored = {s.name: s for s in quantized_specs(specs_of(_named()))}
    stored["model.norm.weight"] = TensorSpec(name="model.norm.weight", dtype="float32", shape=(256,))
    bf16, fp8 = spec_forms(stored, "bfloat16")
    assert set(bf16) == {n for n, _ in _named()}
    assert {s.dtype for s in bf16.values()} == {"bfloat16"}
    assert fp8["model.layers.0.self_attn.q_proj.weight"].dtype == "float8_e4m3fn"
    assert fp8["model.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == "float32"  # not the runtime dtype
    assert fp8["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 2)
    assert fp8["model.norm.weight"].dtype == "bfloat16"


def test_fp8_forms_pick_the_form_and_keep_weights_with_their_scales(tmp_path, tiny_model):
    assert Fp8Forms.of_checkpoint(tiny_model, "bfloat16") is None  # not an FP8 checkpoint
    forms = Fp8Forms.of_checkpoint(fp8_block_checkpoint(tiny_model, tmp_path / "fp8"), "bfloat16")
    assert forms is not None
    q = "model.layers.1.self_attn.q_proj.weight"
    assert q in forms.quantized and "model.norm.weight" not in forms.quantized and len(forms.quantized) == 14
    assert forms.specs_for(forms.bf16) is forms.bf16 and forms.specs_for(forms.fp8) is forms.fp8
    assert forms.problems(forms.bf16) == [] and forms.problems(forms.fp8) == []
    assert forms.problems([q, "model.norm.weight"]) == []  # BF16 form, partial: fine
    assert forms.problems([q + "_scale_inv"]) == [f"'{q}_scale_inv' comes without '{q}'"]
    # A partial FP8 push: each weight it carries needs its scales.
    assert forms.problems([q, "model.layers.0.mlp.up_proj.weight_scale_inv", "model.layers.0.mlp.up_proj.weight"]) == [
        f"'{q}' comes without its scales '{q}_scale_inv'"
    ]


def test_checkpoint_writer(tmp_path, tiny_model):
    from safetensors.torch import load_file

    dst = fp8_block_checkpoint(tiny_model, tmp_path / "fp8")
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert QUANTIZATION_CONFIG == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    }
    assert read_block_config(dst) == (128, 128) and read_block_config(tiny_model) is None
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / f).read_bytes() == (tiny_model / f).read_bytes()
    src = load_file(str(tiny_model / "model.safetensors"))
    got = load_file(str(dst / "model.safetensors"))
    quantized = [n for n in src if is_fp8_quantized(n, src[n].shape)]
    assert len(quantized) == 2 * 7  # two layers, seven projections each
    assert set(got) == set(src) | {n + "_scale_inv" for n in quantized}
    for name in quantized:
        assert got[name].dtype == torch.float8_e4m3fn
        back = dequantize_fp8_block(got[name], got[name + "_scale_inv"])
        assert (back - src[name].float()).abs().max() <= src[name].float().abs().max() / 16
    assert torch.equal(got["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    with pytest.raises(FileExistsError):
        fp8_block_checkpoint(tiny_model, dst)


def test_cached_copy_is_built_once(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("ROLLOUT_ENGINES_CACHE", str(tmp_path))
    first = fp8_block_checkpoint_cached(tiny_model)
    assert first.parent == tmp_path / "fp8-block"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert fp8_block_checkpoint_cached(tiny_model) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


class _DictTarget:
    """A WeightTarget over plain named tensors (what a push leaves, by name)."""

    def __init__(self, specs):
        self.specs = {s.name: s for s in specs}
        self.got: dict[str, torch.Tensor] = {}

    def expected_specs(self):
        return self.specs

    def apply(self, named, *, owned):
        self.got.update((n, t.clone()) for n, t in named)


def test_sender_side_quantization_sends_the_fp8_form():
    """``push(quantize="fp8_block")`` quantizes on the trainer: the engine receives each quantized
    weight as float8_e4m3fn plus its float32 scales, and a BF16 push into that form is refused."""
    from module_engine import ModuleEngine  # type: ignore[import-not-found]
    from rollout_engines import EngineConfig
    from rollout_engines.errors import ManifestMismatch
    from rollout_engines.weights.session import connect_weight_sync

    named = dict(_named())
    engine = ModuleEngine(EngineConfig(backend="module", model="x"))
    target = engine.receiver.target = _DictTarget(quantized_specs(specs_of(named.items())))

    async def go():
        sync = await connect_weight_sync([engine], "inproc")
        try:
            await sync.push(named, version=1, quantize="fp8_block")
            # Lazily, from a generator with specs, too.
            await sync.push(iter(named.items()), version=2, quantize="fp8_block", specs=specs_of(named.items()))
            with pytest.raises(ManifestMismatch, match="dtype"):
                await sync.push(named, version=3)
        finally:
            await sync.close()
            await engine.close()

    asyncio.run(go())
    name = "model.layers.0.mlp.down_proj.weight"
    assert target.got[name].dtype == torch.float8_e4m3fn
    q, s = quantize_fp8_block(named[name])
    assert torch.equal(target.got[name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(target.got[name + "_scale_inv"], s)
    assert torch.equal(target.got["model.norm.weight"], named["model.norm.weight"])
