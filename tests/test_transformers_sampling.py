"""The embedded `transformers` engine's sampling values as the request gives them: top-k's disabled
values, and seeds, which must tell requests apart over their whole signed 64-bit range."""

from __future__ import annotations

import pytest
import torch
from rollout_engines import GenerateRequest, SamplingParams
from rollout_engines.backends.transformers.engine import TransformersEngine
from rollout_engines.backends.transformers.sampling import row_generator, sampling_state

pytestmark = pytest.mark.transformers

PROMPT = ["Once"]


def sampled(seed: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=seed, **kw)


async def tokens(engine: TransformersEngine, params: SamplingParams) -> list[int]:
    return (await engine.generate(GenerateRequest(prompts=PROMPT, sampling=params)))[0].token_ids


async def test_top_k_zero_disables_top_k_even_unvalidated(engine: TransformersEngine) -> None:
    """``top_k=0`` means disabled (vLLM's reading), also when it reaches the engine without the
    field's validator (an assignment after construction): it samples as ``top_k=-1`` does."""
    params = sampled(11)
    params.top_k = 0  # assignment is not validated: the engine sees the 0 itself
    assert params.top_k == 0
    assert sampling_state(params, vocab=50).top_k == 50
    assert await tokens(engine, params) == await tokens(engine, sampled(11))


def _draws(seed: int, sample_index: int = 0) -> list[float]:
    gen = row_generator(seed, sample_index, torch.device("cpu"))
    return torch.empty(8).exponential_(generator=gen).tolist()


def test_seeds_differing_only_above_32_bits_draw_differently() -> None:
    # torch's CPU generator keeps only the low 32 bits of its seed.
    for a, b in [(5, 5 + 2**32), (-1, 2**63 - 1), (-5, 2**63 - 5), (0, 2**63), (7, 7 - 2**32)]:
        if b >= 2**63:
            b -= 2**64  # SamplingParams.seed is signed
        assert _draws(a) != _draws(b), (a, b)
    # A seed in [0, 2**32) seeds sample 0 itself (streams of existing seeds unchanged), and
    # every seed is reproducible.
    assert row_generator(12345, 0, torch.device("cpu")).initial_seed() == 12345
    for seed in (3, -3, 2**40 + 3):
        assert _draws(seed) == _draws(seed) and _draws(seed, 1) == _draws(seed, 1)
        assert _draws(seed) != _draws(seed, 1)


async def test_distinct_seeds_give_distinct_tokens(engine: TransformersEngine) -> None:
    """Seeds that agree in their low 32 bits are still different seeds (docs/backends.md: another
    seed gives different tokens)."""
    for a, b in [(5, 5 + 2**32), (-1, 2**63 - 1)]:
        first, second = await tokens(engine, sampled(a)), await tokens(engine, sampled(b))
        assert first != second, (a, b)
        assert await tokens(engine, sampled(a)) == first  # and each is reproducible
