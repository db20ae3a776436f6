"""FP8 rollouts from a BF16 trainer on a CUDA GPU (issue 19, item 3): an engine serving the FP8 block
copy of a BF16 checkpoint (option ``weight_quantization="fp8_block"``) next to one serving the BF16
checkpoint.

Tolerance: what FP8 alone does to these logprobs is computed here, from the same weights, in a
float32 forward pass (transformers) with every projection's weights quantized to e4m3 in 128x128
blocks and its inputs in 1x128 groups, as vLLM's block-FP8 linear layers do. The FP8 engine's
teacher-forced prompt logprobs may differ from the BF16 engine's by at most 1.5x that mean gap
(+0.02 nats for bf16 arithmetic) and 2x its largest (+0.1); a wrong scale or layout moves them by
nats. On the 2-layer test model the simulation gives a mean of 0.154 nats (largest 0.550), and the
engine measured 0.157 (0.648) on an H200 with vLLM 0.26.
After a push of perturbed weights the FP8 engine follows the perturbed BF16 reference within the
same kind of bound, and is nearer to it than to its own earlier state by a wide margin.

Without DeepGEMM's JIT headers (a stripped vLLM install) run with ``VLLM_USE_DEEP_GEMM=0``.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from rollout_engines import GenerateRequest, SamplingParams, create_engine
from rollout_engines.errors import ManifestMismatch
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.fp8 import dequantize_fp8_block, quantize_fp8_block
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.vllm, pytest.mark.gpu, pytest.mark.timeout(1200)]

if not torch.cuda.is_available():
    pytest.skip("FP8 block kernels need a CUDA GPU", allow_module_level=True)

PROMPTS = [[(i * 37 + p * 101) % 4000 + 10 for i in range(96)] for p in range(4)]
TEACHER_FORCED = GenerateRequest(
    prompt_token_ids=PROMPTS, sampling=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
)
COMMON = {"dtype": "bfloat16", "gpu_memory_utilization": 0.2, "enable_sleep_mode": False, "enforce_eager": True}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer Qwen3 of width 512 (head_dim 128, one KV head: every projection fills 128-row
    blocks, as vLLM's FP8 block layers require), vocabulary 4096, spread-out logits."""
    from rollout_engines.testing import shapes

    shape = replace(shapes.SHAPES["qwen3-0.6b"], hidden=512, heads=4, kv_heads=1, intermediate=1024,
                    vocab_size=4096, max_positions=2048, init_std=0.06)
    shapes.SHAPES["fp8-test"] = shape
    try:
        return shapes.build_shape("fp8-test", tmp_path_factory.mktemp("fp8") / "model", layers=2, device="cuda")
    finally:
        del shapes.SHAPES["fp8-test"]


@pytest.fixture(scope="module")
def original(model_dir):
    return {k: v.cuda() for k, v in load_checkpoint(model_dir, dtype=torch.bfloat16).items()}


@pytest.fixture(scope="module")
def changed(original):
    return perturbed(original, scale=0.5, seed=3)


@pytest.fixture(scope="module")
def engines(model_dir):
    bf16 = create_engine("vllm", model=str(model_dir), **COMMON)
    fp8 = create_engine("vllm", model=str(model_dir), weight_quantization="fp8_block", **COMMON)
    yield bf16, fp8
    run(fp8.close())
    run(bf16.close())


async def prompt_logprobs(engine) -> torch.Tensor:
    out = await engine.generate(TEACHER_FORCED)
    return torch.tensor([lp for c in out for lp in c.prompt_logprobs[1:]], dtype=torch.float64)


async def fingerprint(engine):
    return (await engine.diagnostics(fingerprint=True)).weights_fingerprint


def gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a - b).abs()
    return float(d.mean()), float(d.max())


def fp8_simulation_gap(model_dir, weights, device="cuda") -> tuple[float, float]:
    """Mean and largest |logprob| change that FP8 block quantization alone makes to the prompts'
    teacher-forced logprobs, for ``weights`` (float32 arithmetic, so nothing else differs)."""
    from rollout_engines.weights.fp8 import FP8_DTYPE, FP8_MAX, is_fp8_quantized
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)

    def logprobs() -> torch.Tensor:
        out = []
        with torch.no_grad():
            for p in PROMPTS:
                lsm = model(torch.tensor([p], device=device)).logits[0].float().log_softmax(-1)
                out.append(lsm[:-1].gather(-1, torch.tensor(p[1:], device=device)[:, None])[:, 0])
        return torch.cat(out).double().cpu()

    def fp8_inputs(_module, args):  # e4m3 in 1x128 groups, one scale per group
        x = args[0]
        g = x.reshape(-1, x.shape[-1] // 128, 128)
        scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
        return ((g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale).reshape(x.shape), *args[1:]

    ref = logprobs()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_fp8_quantized(f"{name}.weight", module.weight.shape):
            module.weight.data.copy_(dequantize_fp8_block(*quantize_fp8_block(module.weight.data)))
            module.register_forward_pre_hook(fp8_inputs)
    return gap(logprobs(), ref)


def within_fp8_error(measured: tuple[float, float], simulated: tuple[float, float]) -> bool:
    return measured[0] <= 1.5 * simulated[0] + 0.02 and measured[1] <= 2 * simulated[1] + 0.1


async def push(engine, tensors, **kw):
    sync = await connect_weight_sync([engine], "cuda_ipc")
    try:
        await sync.push(tensors, version=engine.weight_version + 1, **kw)
    finally:
        await sync.close()


def test_triton_quantizer_matches_the_reference():
    from rollout_engines_vllm.fp8_apply import _triton_quantizer

    quantize = _triton_quantizer()
    if quantize is None:
        pytest.skip("no Triton")
    torch.manual_seed(0)
    for shape in [(512, 1024), (300, 200), (1, 129)]:
        w = (torch.randn(shape, device="cuda") * torch.logspace(-3, 1, shape[0], device="cuda")[:, None]).bfloat16()
        q_ref, s_ref = quantize_fp8_block(w)
        q, s = torch.empty_like(q_ref), torch.empty_like(s_ref)
        # Into strided views, as into the rows of a fused parameter.
        big_q = torch.zeros(shape[0] + 256, shape[1], dtype=q.dtype, device="cuda")
        big_s = torch.zeros(s.shape[0] + 2, s.shape[1], device="cuda")
        quantize(w, big_q[128:128 + shape[0]], big_s[1:1 + s.shape[0]], (128, 128))
        q, s = big_q[128:128 + shape[0]], big_s[1:1 + s.shape[0]]
        assert torch.equal(s, s_ref)
        same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean()
        assert same > 0.999, float(same)
        err = (dequantize_fp8_block(q, s) - w.float()).abs().max()
        assert err <= w.float().abs().max() / 16
        assert bool((big_q[:128].view(torch.uint8) == 0).all())  # nothing written outside the view


def test_fp8_engine_agrees_with_bf16(engines, model_dir, original):
    bf16, fp8 = engines

    async def go():
        return await prompt_logprobs(bf16), await prompt_logprobs(fp8)

    ref, got = run(go())
    measured, simulated = gap(got, ref), fp8_simulation_gap(model_dir, original)
    print(f"FP8 vs BF16 prompt logprobs: mean |d| {measured[0]:.4f}, max {measured[1]:.4f} over {ref.numel()} "
          f"positions; FP8 quantization simulated in float32: mean {simulated[0]:.4f}, max {simulated[1]:.4f}")
    assert within_fp8_error(measured, simulated)


def test_pushes_into_the_fp8_engine(engines, model_dir, original, changed):
    bf16, fp8 = engines
    simulated = fp8_simulation_gap(model_dir, changed)

    async def go():
        ref0 = await prompt_logprobs(bf16)
        fp0, start = await prompt_logprobs(fp8), await fingerprint(fp8)
        await push(bf16, changed)
        ref1 = await prompt_logprobs(bf16)
        moved = gap(ref1, ref0)[0]
        assert moved > 4 * simulated[0], "the perturbation must move the logprobs more than FP8 does"

        # BF16 push, quantized in the engine's worker.
        v = fp8.weight_version
        await push(fp8, changed)
        assert fp8.weight_version == v + 1
        got = await prompt_logprobs(fp8)
        measured = gap(got, ref1)
        print(f"after a BF16 push: FP8 vs BF16 mean |d| {measured[0]:.4f}, max {measured[1]:.4f} (simulated "
              f"{simulated[0]:.4f}, {simulated[1]:.4f}); the push moved {moved:.4f}")
        assert within_fp8_error(measured, simulated) and measured[0] < 0.25 * moved
        changed_print = await fingerprint(fp8)
        assert changed_print != start

        # A bad push (one projection of the wrong shape) is refused with nothing applied.
        bad = dict(changed)
        name = "model.layers.1.mlp.down_proj.weight"
        bad[name] = torch.zeros(bad[name].shape[0], bad[name].shape[1] + 1, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ManifestMismatch, match="shape"):
            await push(fp8, bad)
        assert await fingerprint(fp8) == changed_print
        assert gap(await prompt_logprobs(fp8), got)[1] <= 1e-5
        # An FP8-form push without one weight's scales: refused too.
        from rollout_engines.weights.fp8 import quantize_named

        fp8_form = dict(quantize_named(original.items()))
        del fp8_form["model.layers.0.self_attn.q_proj.weight_scale_inv"]
        with pytest.raises(ManifestMismatch):
            await push(fp8, fp8_form, partial=True)
        assert await fingerprint(fp8) == changed_print

        # The originals, quantized by the trainer (the quantizer that built the FP8 copy): back to
        # exactly the start.
        await push(fp8, original, quantize="fp8_block")
        assert await fingerprint(fp8) == start
        assert gap(await prompt_logprobs(fp8), fp0)[1] <= 1e-6

        # And the originals in BF16, quantized in the worker: the same weights but for rare
        # rounding differences of the GPU quantizer.
        await push(fp8, changed)
        await push(fp8, original)
        assert gap(await prompt_logprobs(fp8), fp0)[0] <= 1e-3

    run(go())


def test_reload_path_gives_the_same_weights(model_dir, original, changed):
    """Where the direct layout is not known (another kernel), pushes go through vLLM's
    reload_weights. Forced here by the engine option ``fp8_apply="reload"``; the worker reports each
    load through reload_weights; results equal the direct path's."""
    engine = create_engine("vllm", model=str(model_dir), weight_quantization="fp8_block", fp8_apply="reload", **COMMON)

    async def go():
        start, lp0 = await fingerprint(engine), await prompt_logprobs(engine)
        await push(engine, changed, quantize="fp8_block")
        assert await fingerprint(engine) != start
        await push(engine, original, quantize="fp8_block")
        assert await fingerprint(engine) == start
        assert gap(await prompt_logprobs(engine), lp0)[1] <= 1e-6
        await push(engine, changed)  # BF16, quantized by the worker before reload_weights
        assert await fingerprint(engine) != start
        [reloads] = await engine._rpc("roe_fp8_reloads")
        assert len(reloads) == 3 and all(n == 2 * 7 for n in reloads)

    try:
        run(go())
    finally:
        run(engine.close())
