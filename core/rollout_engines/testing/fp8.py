"""What the FP8 tests of every backend share: a model whose projections fill FP8 blocks, teacher-forced
prompt logprobs, and the tolerance an FP8 engine is held to.

Tolerance: what FP8 alone does to these logprobs is computed from the same weights in a float32
forward pass (transformers) with every projection's weights quantized to e4m3 in 128x128 blocks
and its inputs in 1x128 groups, as the engines' block-FP8 linear layers do
(:func:`fp8_simulation_gap`). An FP8 engine's teacher-forced prompt logprobs may differ from the
BF16 engine's by at most 1.5x that mean gap (+0.02 nats for bf16 arithmetic) and 2x its largest
(+0.1) (:func:`within_fp8_error`); a wrong scale or layout moves them by nats.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..types import GenerateRequest, SamplingParams

#: Four prompts of 96 tokens below the test model's vocabulary.
PROMPTS = [[(i * 37 + p * 101) % 4000 + 10 for i in range(96)] for p in range(4)]
#: One token each, with the logprob of every prompt token under the weights (greedy).
TEACHER_FORCED = GenerateRequest(
    prompt_token_ids=PROMPTS, sampling=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
)


def build_fp8_test_model(out_dir: str | Path, device: str = "cuda") -> Path:
    """A 2-layer Qwen3 of width 512 (head_dim 128, one KV head: every projection fills 128-row
    blocks, as block-FP8 layers of fused modules require), vocabulary 4096, spread-out logits."""
    from . import shapes

    shape = replace(shapes.SHAPES["qwen3-0.6b"], hidden=512, heads=4, kv_heads=1, intermediate=1024,
                    vocab_size=4096, max_positions=2048, init_std=0.06)
    shapes.SHAPES["fp8-test"] = shape
    try:
        return shapes.build_shape("fp8-test", out_dir, layers=2, device=device)
    finally:
        del shapes.SHAPES["fp8-test"]


async def prompt_logprobs(engine: Any) -> torch.Tensor:
    """The teacher-forced logprobs of :data:`PROMPTS` (after each first token), float64."""
    out = await engine.generate(TEACHER_FORCED)
    return torch.tensor([lp for c in out for lp in c.prompt_logprobs[1:]], dtype=torch.float64)


async def weights_fingerprint(engine: Any) -> Any:
    """The engine's weights fingerprint (``diagnostics(fingerprint=True)``)."""
    return (await engine.diagnostics(fingerprint=True)).weights_fingerprint


def gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Mean and largest absolute difference."""
    d = (a - b).abs()
    return float(d.mean()), float(d.max())


def fp8_simulation_gap(model_dir: str | Path, weights: dict[str, torch.Tensor], device: str = "cuda") -> tuple[float, float]:
    """Mean and largest |logprob| change that FP8 block quantization alone makes to the prompts'
    teacher-forced logprobs, for ``weights`` (float32 arithmetic, so nothing else differs)."""
    from transformers import AutoModelForCausalLM

    from ..weights.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8_block, is_fp8_quantized, quantize_fp8_block

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()  # type: ignore[arg-type]
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)

    def logprobs() -> torch.Tensor:
        out = []
        with torch.no_grad():
            for p in PROMPTS:
                lsm = model(torch.tensor([p], device=device)).logits[0].float().log_softmax(-1)
                out.append(lsm[:-1].gather(-1, torch.tensor(p[1:], device=device)[:, None])[:, 0])
        return torch.cat(out).double().cpu()

    def fp8_inputs(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:  # e4m3 in 1x128 groups
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


async def bf16_push_follows_the_reference(
    bf16: Any, fp8: Any, push: Callable[[Any, dict[str, torch.Tensor]], Awaitable[Any]],
    changed: dict[str, torch.Tensor], simulated: tuple[float, float],
) -> tuple[torch.Tensor, Any, Any, torch.Tensor]:
    """What every backend's FP8 test checks first: ``changed`` (BF16) pushed into the BF16 engine
    moves its logprobs well beyond what FP8 explains, and pushed (BF16) into the FP8 engine it
    advances the version, changes the fingerprint and makes the FP8 engine follow the BF16 one
    within :func:`within_fp8_error` (and far nearer to it than the push moved it). ``push(engine,
    tensors)`` is the test's push. Returns ``(fp8 logprobs before, fingerprint before, fingerprint
    after, fp8 logprobs after)``."""
    ref0 = await prompt_logprobs(bf16)
    fp0, start = await prompt_logprobs(fp8), await weights_fingerprint(fp8)
    assert start is not None, "the FP8 engine gives no weights fingerprint"
    await push(bf16, changed)
    ref1 = await prompt_logprobs(bf16)
    moved = gap(ref1, ref0)[0]
    assert moved > 4 * simulated[0], "the perturbation must move the logprobs more than FP8 does"
    version = fp8.weight_version
    await push(fp8, changed)
    assert fp8.weight_version == version + 1
    got = await prompt_logprobs(fp8)
    measured = gap(got, ref1)
    print(f"after a BF16 push: {fp8.backend_name} FP8 vs BF16 mean |d| {measured[0]:.4f}, max {measured[1]:.4f} "
          f"(simulated {simulated[0]:.4f}, {simulated[1]:.4f}); the push moved {moved:.4f}")
    assert within_fp8_error(measured, simulated) and measured[0] < 0.25 * moved
    after = await weights_fingerprint(fp8)
    assert after != start
    return fp0, start, after, got


def within_fp8_error(measured: tuple[float, float], simulated: tuple[float, float]) -> bool:
    """Whether a measured (mean, largest) gap is what FP8 explains (see the module docstring)."""
    return measured[0] <= 1.5 * simulated[0] + 0.02 and measured[1] <= 2 * simulated[1] + 0.1


__all__ = ["PROMPTS", "TEACHER_FORCED", "bf16_push_follows_the_reference", "build_fp8_test_model", "fp8_simulation_gap", "gap", "prompt_logprobs",
           "weights_fingerprint", "within_fp8_error"]
