"""Copy plans at their edges: a plan learned from a tensor laid out otherwise than the ones it later
replays (a transposed or strided view the first time, contiguous tensors after)."""

from __future__ import annotations

import torch
from rollout_engines.weights.copy_plan import PlannedLoader, record_copy_plan
from test_copy_plan import FusedLikeVllm, _bucket_views, _weights


def _same(planned: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    return [n for (n, a), b in zip(planned.named_parameters(), reference.parameters(), strict=True)
            if not torch.equal(a, b)]


def _strided(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The same values, ``q`` as a transposed view and ``embed`` as every other row of a bigger tensor."""
    out = []
    for name, t in named:
        if name == "q":
            t = t.t().contiguous().t()
        elif name == "embed":
            wide = torch.zeros(2 * t.shape[0], t.shape[1])
            wide[::2] = t
            t = wide[::2]
        out.append((name, t))
    return out


def test_planned_loader_learned_from_strided_views_replays_contiguous_tensors_exactly():
    planned, reference = FusedLikeVllm(), FusedLikeVllm()
    loader = PlannedLoader()
    first = _strided(_weights(0))
    assert not first[0][1].is_contiguous()
    loader.apply(first, planned.load_weights, owned=False)
    reference.load_weights(first)
    assert _same(planned, reference) == []
    for seed in (1, 2):  # contiguous from now on: replayed by the plan
        new = _weights(seed)
        loader.apply(_bucket_views(new), planned.load_weights, owned=False)
        reference.load_weights(new)
        assert _same(planned, reference) == [], seed


def test_copy_plan_recorded_on_strided_tensors_replays_contiguous_tensors_exactly():
    planned, reference = FusedLikeVllm(), FusedLikeVllm()
    plan = record_copy_plan(_strided(_weights(0)), planned.load_weights)
    new = _weights(1)
    plan.apply(_bucket_views(new), planned.load_weights)
    reference.load_weights(new)
    assert _same(planned, reference) == []
