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
    build_fp8_test_model,
    fp8_simulation_gap,
    gap,
    prompt_logprobs,
    within_fp8_error,
)
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
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
def model_dir(tmp_path_factory):
    return build_fp8_test_model(tmp_path_factory.mktemp("fp8") / "model")


@pytest.fixture(scope="module")
def original(model_dir):
    return {k: v.cuda() for k, v in load_checkpoint(model_dir, dtype=torch.bfloat16).items()}


@pytest.fixture(scope="module")
def changed(original):
    return perturbed(original, scale=0.5, seed=3)


@pytest.fixture(scope="module")
def engines(model_dir):
    bf16 = create_engine("sglang", model=str(model_dir), **COMMON)
    try:
        fp8 = create_engine("sglang", model=str(model_dir), **COMMON, **FP8)
    except BaseException:
        run(bf16.close())
        raise
    yield bf16, fp8
    run(fp8.close())
    run(bf16.close())


async def fingerprint(engine):
    return (await engine.diagnostics(fingerprint=True)).weights_fingerprint


async def push(engine, tensors, transport="cuda_ipc", **kw):
    options = kw.pop("options", None)
    sync = await connect_weight_sync([engine], transport, timeout_s=120, **({"options": options} if options else {}))
    try:
        await sync.push(tensors, version=engine.weight_version + 1, **kw)
    finally:
        await sync.close()


def test_fp8_engine_agrees_with_bf16(engines, model_dir, original):
    bf16, fp8 = engines

    async def go():
        return await prompt_logprobs(bf16), await prompt_logprobs(fp8)

    ref, got = run(go())
    measured, simulated = gap(got, ref), fp8_simulation_gap(model_dir, original)
    print(f"SGLang FP8 vs BF16 prompt logprobs: mean |d| {measured[0]:.4f}, max {measured[1]:.4f} over "
          f"{ref.numel()} positions; FP8 simulated in float32: mean {simulated[0]:.4f}, max {simulated[1]:.4f}")
    assert within_fp8_error(measured, simulated)


def test_pushes_into_the_fp8_engine(engines, model_dir, original, changed, tmp_path):
    bf16, fp8 = engines
    simulated = fp8_simulation_gap(model_dir, changed)

    async def go():
        ref0 = await prompt_logprobs(bf16)
        fp0, start = await prompt_logprobs(fp8), await fingerprint(fp8)
        assert start is not None
        await push(bf16, changed)
        ref1 = await prompt_logprobs(bf16)
        moved = gap(ref1, ref0)[0]
        assert moved > 4 * simulated[0], "the perturbation must move the logprobs more than FP8 does"

        # BF16 push, quantized by the relay.
        v = fp8.weight_version
        await push(fp8, changed)
        assert fp8.weight_version == v + 1
        got = await prompt_logprobs(fp8)
        measured = gap(got, ref1)
        print(f"after a BF16 push: SGLang FP8 vs BF16 mean |d| {measured[0]:.4f}, max {measured[1]:.4f} "
              f"(simulated {simulated[0]:.4f}, {simulated[1]:.4f}); the push moved {moved:.4f}")
        assert within_fp8_error(measured, simulated) and measured[0] < 0.25 * moved
        changed_print = await fingerprint(fp8)
        assert changed_print != start

        # The same weights quantized by the trainer: the same bits.
        await push(fp8, original, quantize="fp8_block")
        assert await fingerprint(fp8) == start
        assert gap(await prompt_logprobs(fp8), fp0)[1] <= 1e-6
        await push(fp8, changed, quantize="fp8_block")
        assert await fingerprint(fp8) == changed_print

        # Bad pushes are refused with nothing applied: a wrong shape, an FP8 weight without its
        # scales, BF16 weights over disk (SGLang would load them unscaled).
        bad = dict(changed)
        name = "model.layers.1.mlp.down_proj.weight"
        bad[name] = torch.zeros(bad[name].shape[0], bad[name].shape[1] + 1, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ManifestMismatch, match="shape"):
            await push(fp8, bad)
        form = dict(quantize_named(original.items()))
        del form["model.layers.0.self_attn.q_proj.weight_scale_inv"]
        with pytest.raises(ManifestMismatch, match="without its scales"):
            await push(fp8, form, partial=True)
        with pytest.raises(ManifestMismatch, match="quantize='fp8_block'"):
            await push(fp8, original, transport="disk", options={"path": str(tmp_path)})
        assert await fingerprint(fp8) == changed_print
        assert gap(await prompt_logprobs(fp8), got)[1] <= 1e-5

        # The FP8 form over disk: SGLang reads the files itself.
        await push(fp8, original, transport="disk", quantize="fp8_block", options={"path": str(tmp_path)})
        assert await fingerprint(fp8) == start

    run(go())
