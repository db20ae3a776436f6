"""FP8 rollouts from a BF16 trainer on a CUDA GPU (issue 19, item 3): an engine serving the FP8 block
copy of a BF16 checkpoint (option ``weight_quantization="fp8_block"``) next to one serving the BF16
checkpoint.

Tolerance: see :mod:`rollout_engines.testing.fp8` (FP8 alone, simulated in float32 on the same
weights). On the 2-layer test model the simulation gives a mean of 0.154 nats (largest 0.550), and
the engine measured 0.157 (0.648) on an H200 with vLLM 0.26.
After a push of perturbed weights the FP8 engine follows the perturbed BF16 reference within the
same kind of bound, and is nearer to it than to its own earlier state by a wide margin.

Without DeepGEMM's JIT headers (a stripped vLLM install) run with ``VLLM_USE_DEEP_GEMM=0``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_engines import create_engine
from rollout_engines.errors import ManifestMismatch
from rollout_engines.testing.fp8 import (
    bf16_push_follows_the_reference,
    fp8_simulation_gap,
    gap,
    prompt_logprobs,
    within_fp8_error,
)
from rollout_engines.testing.fp8 import (
    weights_fingerprint as fingerprint,
)
from rollout_engines.weights.fp8 import dequantize_fp8_block, quantize_fp8_block
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.vllm, pytest.mark.gpu, pytest.mark.timeout(1200)]

if not torch.cuda.is_available():
    pytest.skip("FP8 block kernels need a CUDA GPU", allow_module_level=True)

COMMON = {"dtype": "bfloat16", "gpu_memory_utilization": 0.2, "enable_sleep_mode": False, "enforce_eager": True}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def engines(fp8_model_dir):
    bf16 = create_engine("vllm", model=str(fp8_model_dir), **COMMON)
    fp8 = create_engine("vllm", model=str(fp8_model_dir), weight_quantization="fp8_block", **COMMON)
    yield bf16, fp8
    run(fp8.close())
    run(bf16.close())


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


def test_fp8_engine_agrees_with_bf16(engines, fp8_model_dir, fp8_original):
    bf16, fp8 = engines

    async def go():
        return await prompt_logprobs(bf16), await prompt_logprobs(fp8)

    ref, got = run(go())
    measured, simulated = gap(got, ref), fp8_simulation_gap(fp8_model_dir, fp8_original)
    print(f"FP8 vs BF16 prompt logprobs: mean |d| {measured[0]:.4f}, max {measured[1]:.4f} over {ref.numel()} "
          f"positions; FP8 quantization simulated in float32: mean {simulated[0]:.4f}, max {simulated[1]:.4f}")
    assert within_fp8_error(measured, simulated)


def test_pushes_into_the_fp8_engine(engines, fp8_model_dir, fp8_original, fp8_changed):
    bf16, fp8 = engines
    simulated = fp8_simulation_gap(fp8_model_dir, fp8_changed)

    async def go():
        # BF16 push, quantized by the engine (its workers).
        fp0, start, changed_print, got = await bf16_push_follows_the_reference(bf16, fp8, push, fp8_changed, simulated)

        # A bad push (one projection of the wrong shape) is refused with nothing applied.
        bad = dict(fp8_changed)
        name = "model.layers.1.mlp.down_proj.weight"
        bad[name] = torch.zeros(bad[name].shape[0], bad[name].shape[1] + 1, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ManifestMismatch, match="shape"):
            await push(fp8, bad)
        assert await fingerprint(fp8) == changed_print
        assert gap(await prompt_logprobs(fp8), got)[1] <= 1e-5
        # An FP8-form push without one weight's scales: refused too.
        from rollout_engines.weights.fp8 import quantize_named

        fp8_form = dict(quantize_named(fp8_original.items()))
        del fp8_form["model.layers.0.self_attn.q_proj.weight_scale_inv"]
        with pytest.raises(ManifestMismatch):
            await push(fp8, fp8_form, partial=True)
        assert await fingerprint(fp8) == changed_print

        # The originals, quantized by the trainer (the quantizer that built the FP8 copy): back to
        # exactly the start.
        await push(fp8, fp8_original, quantize="fp8_block")
        assert await fingerprint(fp8) == start
        assert gap(await prompt_logprobs(fp8), fp0)[1] <= 1e-6

        # And the originals in BF16, quantized in the worker: the same weights but for rare
        # rounding differences of the GPU quantizer.
        await push(fp8, fp8_changed)
        await push(fp8, fp8_original)
        assert gap(await prompt_logprobs(fp8), fp0)[0] <= 1e-3

    run(go())


def test_reload_path_gives_the_same_weights(fp8_model_dir, fp8_original, fp8_changed):
    """Where the direct layout is not known (another kernel), pushes go through vLLM's
    reload_weights. Forced here by the engine option ``fp8_apply="reload"``; the worker reports each
    load through reload_weights; results equal the direct path's."""
    engine = create_engine("vllm", model=str(fp8_model_dir), weight_quantization="fp8_block", fp8_apply="reload", **COMMON)

    async def go():
        start, lp0 = await fingerprint(engine), await prompt_logprobs(engine)
        await push(engine, fp8_changed, quantize="fp8_block")
        assert await fingerprint(engine) != start
        await push(engine, fp8_original, quantize="fp8_block")
        assert await fingerprint(engine) == start
        assert gap(await prompt_logprobs(engine), lp0)[1] <= 1e-6
        await push(engine, fp8_changed)  # BF16, quantized by the worker before reload_weights
        assert await fingerprint(engine) != start
        [reloads] = await engine._rpc("roe_fp8_reloads")
        assert len(reloads) == 3 and all(n == 2 * 7 for n in reloads)

    try:
        run(go())
    finally:
        run(engine.close())
