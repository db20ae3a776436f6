"""FP8 rollouts from a BF16 trainer on SGLang (issue 19, item 3; real SGLang on a CUDA GPU): an engine
serving the FP8 block copy of a BF16 checkpoint (option ``weight_quantization="fp8_block"``; SGLang
reads the copy's ``quantization_config`` and runs its block-FP8 linear layers) next to one serving
the BF16 checkpoint.

SGLang loads pushed tensors with the model's own ``load_weights``, which writes FP8 weights and
their block scales into its parameters as they are. So BF16 pushes are quantized by the engine's
relay on the GPU before SGLang loads them (the same quantizer as ``push(quantize="fp8_block")``
on the trainer, so both forms land the same bits), and the fingerprint is SGLang's own weights
checksum (``check_weights``: every parameter, FP8 weights dequantized with their scales).
Tolerance: :mod:`rollout_engines.testing.fp8`.
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
from rollout_engines.weights.fp8 import quantize_named
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.sglang, pytest.mark.gpu, pytest.mark.timeout(1200)]

if not torch.cuda.is_available():
    pytest.skip("SGLang's FP8 block kernels need a CUDA GPU", allow_module_level=True)
pytest.importorskip("sglang")

COMMON = {"dtype": "bfloat16", "mem_fraction_static": 0.2, "disable_cuda_graph": True,
          "attention_backend": "triton", "sampling_backend": "pytorch", "start_timeout_s": 300}
#: SGLang's Triton block-FP8 GEMM (its DeepGEMM path JIT-compiles with the CUDA toolkit).
FP8 = {"weight_quantization": "fp8_block", "fp8_gemm_runner_backend": "triton"}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def engines(fp8_model_dir):
    bf16 = create_engine("sglang", model=str(fp8_model_dir), **COMMON)
    try:
        fp8 = create_engine("sglang", model=str(fp8_model_dir), **COMMON, **FP8)
    except BaseException:
        run(bf16.close())
        raise
    yield bf16, fp8
    run(fp8.close())
    run(bf16.close())


async def push(engine, tensors, transport="cuda_ipc", **kw):
    options = kw.pop("options", None)
    sync = await connect_weight_sync([engine], transport, timeout_s=120, **({"options": options} if options else {}))
    try:
        await sync.push(tensors, version=engine.weight_version + 1, **kw)
    finally:
        await sync.close()


def test_fp8_engine_agrees_with_bf16(engines, fp8_model_dir, fp8_original):
    bf16, fp8 = engines

    async def go():
        return await prompt_logprobs(bf16), await prompt_logprobs(fp8)

    ref, got = run(go())
    measured, simulated = gap(got, ref), fp8_simulation_gap(fp8_model_dir, fp8_original)
    print(f"SGLang FP8 vs BF16 prompt logprobs: mean |d| {measured[0]:.4f}, max {measured[1]:.4f} over "
          f"{ref.numel()} positions; FP8 simulated in float32: mean {simulated[0]:.4f}, max {simulated[1]:.4f}")
    assert within_fp8_error(measured, simulated)


def test_pushes_into_the_fp8_engine(engines, fp8_model_dir, fp8_original, fp8_changed, tmp_path):
    bf16, fp8 = engines
    simulated = fp8_simulation_gap(fp8_model_dir, fp8_changed)

    async def go():
        # BF16 push, quantized by the engine (its relay).
        fp0, start, changed_print, got = await bf16_push_follows_the_reference(bf16, fp8, push, fp8_changed, simulated)

        # The same weights quantized by the trainer: the same bits.
        await push(fp8, fp8_original, quantize="fp8_block")
        assert await fingerprint(fp8) == start
        assert gap(await prompt_logprobs(fp8), fp0)[1] <= 1e-6
        await push(fp8, fp8_changed, quantize="fp8_block")
        assert await fingerprint(fp8) == changed_print

        # Bad pushes are refused with nothing applied: a wrong shape, an FP8 weight without its
        # scales, BF16 weights over disk (SGLang would load them unscaled).
        bad = dict(fp8_changed)
        name = "model.layers.1.mlp.down_proj.weight"
        bad[name] = torch.zeros(bad[name].shape[0], bad[name].shape[1] + 1, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ManifestMismatch, match="shape"):
            await push(fp8, bad)
        form = dict(quantize_named(fp8_original.items()))
        del form["model.layers.0.self_attn.q_proj.weight_scale_inv"]
        with pytest.raises(ManifestMismatch, match="without its scales"):
            await push(fp8, form, partial=True)
        with pytest.raises(ManifestMismatch, match="quantize='fp8_block'"):
            await push(fp8, fp8_original, transport="disk", options={"path": str(tmp_path)})
        assert await fingerprint(fp8) == changed_print
        assert gap(await prompt_logprobs(fp8), got)[1] <= 1e-5

        # The FP8 form over disk: SGLang reads the files itself.
        await push(fp8, fp8_original, transport="disk", quantize="fp8_block", options={"path": str(tmp_path)})
        assert await fingerprint(fp8) == start

    run(go())
