"""One sampling step over a batch whose rows may each have their own sampling parameters.

Semantics follow vLLM's sampler so that the backends agree:

- logprobs are those of the *unmodified* distribution (log-softmax of the raw logits), whatever
  temperature / top-k / top-p / min-p did to the sampling distribution;
- temperature below ``GREEDY_EPS`` means greedy (argmax of the raw logits);
- otherwise: divide by temperature, drop tokens below ``min_p * max_prob``, then top-k, then
  top-p (always keeping the most likely token), and sample by the exponential-race trick
  (``argmax(p / q)`` with ``q ~ Exp(1)``), which draws exactly ``vocab`` numbers per row and step
  from that row's generator. A seeded row therefore consumes its own random stream only, and its
  tokens do not depend on which other rows share the batch;
- a ``top_k`` above the vocabulary means the whole vocabulary (clamped, as vLLM does).

Each request's parameters are checked and turned into a :class:`RowSampling` on their own
(:func:`sampling_state`) before its rows join a batch, so a request whose values cannot be used
fails alone instead of failing every request merged with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...errors import InvalidRequest
from ...types import SamplingParams

GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class RowSampling:
    """One request's sampling parameters, checked and clamped for a model of a given vocabulary."""

    temperature: float
    top_p: float
    top_k: int  # in [1, vocab]; vocab where top-k is disabled
    min_p: float


def sampling_state(params: SamplingParams, vocab: int) -> RowSampling:
    """Check one request's sampling values and clamp ``top_k`` to the vocabulary.

    The pydantic model already bounds these; this also holds for a model built without validation
    (``model_construct``) or changed after it, so that such a request fails here, alone."""
    temperature, top_p, min_p, top_k = params.temperature, params.top_p, params.min_p, params.top_k
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature >= 0):
        raise InvalidRequest(f"sampling.temperature={temperature!r}: must be a finite number >= 0")
    if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise InvalidRequest(f"sampling.top_p={top_p!r}: must be in (0, 1]")
    if not (isinstance(min_p, int | float) and 0 <= min_p <= 1):
        raise InvalidRequest(f"sampling.min_p={min_p!r}: must be in [0, 1]")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not (top_k in (-1, 0) or top_k >= 1):
        raise InvalidRequest(f"sampling.top_k={top_k!r}: must be -1 or 0 (disabled) or an integer >= 1")
    return RowSampling(
        # 0 disables top-k as -1 does (vLLM's reading; the field's validator maps 0 to -1, an
        # unvalidated assignment does not).
        temperature=float(temperature), top_p=float(top_p), top_k=vocab if top_k in (-1, 0) else min(top_k, vocab),
        min_p=float(min_p),
    )


@dataclass
class RowParams:
    """Per-row sampling parameters as tensors of shape ``[rows]`` on the logits' device."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor  # vocab size where disabled
    min_p: torch.Tensor

    @staticmethod
    def of(states: Sequence[RowSampling], vocab: int, device: torch.device) -> RowParams:
        """Stack checked per-row states (``top_k`` clamped again to this batch's vocabulary)."""
        return RowParams(
            temperature=torch.tensor([s.temperature for s in states], dtype=torch.float32, device=device),
            top_p=torch.tensor([s.top_p for s in states], dtype=torch.float32, device=device),
            top_k=torch.tensor([min(s.top_k, vocab) for s in states], dtype=torch.long, device=device),
            min_p=torch.tensor([s.min_p for s in states], dtype=torch.float32, device=device),
        )

    def select(self, index: torch.Tensor) -> RowParams:
        return RowParams(self.temperature[index], self.top_p[index], self.top_k[index], self.min_p[index])


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude; row-wise parameters."""
    vocab = logits.shape[-1]
    do_k = bool((top_k < vocab).any())
    do_p = bool((top_p < 1.0).any())
    if not (do_k or do_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if do_k:
        # The k-th largest value is at position vocab - k of the ascending sort.
        kth = sorted_logits.gather(-1, (vocab - top_k.clamp(1, vocab)).unsqueeze(-1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if do_p:
        probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p).unsqueeze(-1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: RowParams,
    generators: list[torch.Generator | None],
    shared: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row. Returns ``(tokens [rows], logprobs of those tokens [rows])``.

    ``generators[i]`` is row ``i``'s own generator (seeded requests) or ``None`` (use ``shared``).
    """
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1)
    greedy = params.temperature < GREEDY_EPS
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        scaled = logits / params.temperature.clamp(min=GREEDY_EPS).unsqueeze(-1)
        if bool((params.min_p > 0).any()):
            probs = scaled.softmax(dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * params.min_p.unsqueeze(-1)
            scaled = scaled.masked_fill(probs < threshold, float("-inf"))
        scaled = _apply_top_k_top_p(scaled, params.top_k, params.top_p)
        probs = scaled.softmax(dim=-1)
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            index = torch.tensor(unseeded, device=probs.device)
            q[index] = torch.empty((len(unseeded), probs.shape[-1]), device=probs.device).exponential_(generator=shared)
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        sampled = (probs / q).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, raw_logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


_MASK64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(value: int) -> int:
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def row_generator(seed: int, sample_index: int, device: torch.device) -> torch.Generator:
    """The generator of sample ``sample_index`` of a request seeded with ``seed``.

    Sample 0 of a seed in ``[0, 2**32)`` uses the seed itself; any other seed (negative, or with
    bits above the 32nd) and later samples use a splitmix64-derived value, so ``n`` samples of one
    seeded request differ from each other yet each is reproducible. The mixing matters because
    torch's CPU generator (mt19937) keeps only the low 32 bits of what it is seeded with: seeds
    that differ only above bit 32 (``s`` and ``s + 2**32``, or ``-1`` and ``2**63 - 1``) would
    otherwise draw the same numbers. Distinct seeds then give distinct streams except by a hash
    collision (chance about ``2**-32`` per pair on the CPU).
    """
    value = seed & _MASK64
    if sample_index:
        value = _splitmix64((value + 0x9E3779B97F4A7C15 * sample_index) & _MASK64)
    elif value >> 32:
        value = _splitmix64(value ^ 0xD1B54A32D192ED03)  # its own stream, not any sample's above
    gen = torch.Generator(device=device)
    gen.manual_seed(value & 0x7FFFFFFFFFFFFFFF)  # as before for every seed the mixing leaves alone
    return gen
