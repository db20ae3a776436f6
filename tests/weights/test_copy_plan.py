"""Copy plans with real tensors: a module that loads like vLLM and SGLang do (fused qkv, stacked
gate/up, tied embeddings, a dtype-converting loader) is learned once, then replayed by direct
copies; :class:`PlannedLoader` records new names and replays known ones."""

from __future__ import annotations

import torch
from rollout_engines.weights.copy_plan import PlannedLoader, record_copy_plan


class FusedLikeVllm(torch.nn.Module):
    """Parameters laid out as vLLM lays them out; ``load_weights`` follows vLLM's loaders' pattern
    (narrow the fused parameter, copy_ the checkpoint tensor in). SGLang's loaders do the same."""

    def __init__(self, h: int = 8) -> None:
        super().__init__()
        self.h = h
        self.qkv = torch.nn.Parameter(torch.zeros(3 * h, h), requires_grad=False)
        self.gate_up = torch.nn.Parameter(torch.zeros(2 * h, h), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(16, h), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.zeros(h, dtype=torch.float64), requires_grad=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        slots = {"q": (self.qkv, 0), "k": (self.qkv, 1), "v": (self.qkv, 2), "gate": (self.gate_up, 0), "up": (self.gate_up, 1)}
        for name, w in weights:
            if name in slots:
                param, shard = slots[name]
                param.data.narrow(0, shard * self.h, self.h).copy_(w)
            elif name == "embed":
                self.embed.data.copy_(w)
            elif name == "scale":  # a loader that converts: cannot be replayed as a copy
                self.scale.data.copy_(w.to(torch.float64) * 1.0)


def _weights(seed: int, h: int = 8) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    names = ["q", "k", "v", "gate", "up"]
    out = [(n, torch.randn(h, h, generator=g)) for n in names]
    return out + [("embed", torch.randn(16, h, generator=g)), ("scale", torch.randn(h, generator=g))]


def test_plan_replays_fused_copies_and_falls_back_for_conversions() -> None:
    reference, planned = FusedLikeVllm(), FusedLikeVllm()
    plan = record_copy_plan(_weights(0), planned.load_weights)
    assert set(plan.copies) == {"q", "k", "v", "gate", "up", "embed"}
    assert plan.fallback == {"scale"}

    new = _weights(1)
    # Feed views into one flat buffer, as a received bucket would be.
    flat = torch.cat([t.reshape(-1) for _, t in new])
    views, off = [], 0
    for name, t in new:
        views.append((name, flat[off : off + t.numel()].view(t.shape)))
        off += t.numel()
    fast = plan.apply(views, planned.load_weights)
    reference.load_weights(new)
    assert fast == 6
    for (name, a), b in zip(planned.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_plan_skips_tensors_whose_shape_changed() -> None:
    model = FusedLikeVllm()
    plan = record_copy_plan(_weights(0), model.load_weights)
    assert not plan.covers("q", torch.zeros(4, 8))
    assert plan.covers("q", torch.zeros(8, 8))


def test_same_sources_are_replayed_from_a_cuda_graph_and_new_ones_are_not() -> None:
    """Zero-copy pushes hand the plan the same source tensors every update: the bucket's copies
    are captured once as a CUDA graph and replayed (in-place changes of the sources arrive); new
    source objects are copied eagerly, never through a graph that read the old ones."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reference, planned = FusedLikeVllm().cuda(), FusedLikeVllm().cuda()
    plan = record_copy_plan([(n, t.cuda()) for n, t in _weights(0)], planned.load_weights)
    sources = [(n, t.cuda()) for n, t in _weights(1) if n != "scale"]
    for step in range(4):
        if step == 3:
            sources = [(n, t * 2) for n, t in sources]  # new objects
        else:
            for _, t in sources:
                t.add_(1.0)  # the trainer's in-place update
        plan.apply(sources, planned.load_weights)
        reference.load_weights(sources)
        torch.cuda.synchronize()
        for (name, a), b in zip(planned.named_parameters(), reference.parameters(), strict=True):
            if name != "scale":
                assert torch.equal(a, b), (step, name)
        # captured on the first steady update (step 1), replayed at step 2; step 3 has new sources
        assert plan.copier.replays == [0, 1, 2, 2][step], step


def _bucket_views(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` as views of one flat buffer, as a received bucket hands them over."""
    flat = torch.cat([t.reshape(-1) for _, t in named])
    views, off = [], 0
    for name, t in named:
        views.append((name, flat[off : off + t.numel()].view(t.shape)))
        off += t.numel()
    return views


def test_planned_loader_records_new_names_and_replays_known_ones() -> None:
    reference, planned = FusedLikeVllm(), FusedLikeVllm()
    calls: list[list[str]] = []

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        calls.append([n for n, _ in items])
        planned.load_weights(items)

    loader = PlannedLoader()
    first = _weights(0)
    # Bucket views share one storage: the loader copies new names before recording them.
    loader.apply(_bucket_views(first[:4]), load, owned=False)
    loader.apply(_bucket_views(first[4:]), load, owned=False)
    reference.load_weights(first)
    for (name, a), b in zip(planned.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert set(loader.plan.copies) == {"q", "k", "v", "gate", "up", "embed"}
    assert loader.plan.fallback == {"scale"}

    calls.clear()
    second = _weights(1)
    views = _bucket_views(second)
    loader.apply(views, load, owned=False)
    reference.load_weights(second)
    assert calls == [["scale"]]  # everything else replayed by copies
    for (name, a), b in zip(planned.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
    # Not owned: what reached load_weights was a copy, so changing the bucket afterwards changes nothing.
    before = planned.scale.clone()
    views[-1][1].fill_(123.0)
    assert torch.equal(planned.scale, before)


def test_planned_loader_hands_owned_tensors_through_uncopied() -> None:
    model = FusedLikeVllm()
    seen: list[torch.Tensor] = []

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        seen.extend(t for _, t in items)
        model.load_weights(items)

    loader = PlannedLoader()
    loader.apply(_weights(0), load, owned=True)
    seen.clear()
    again = _weights(1)
    loader.apply(again, load, owned=True)
    assert len(seen) == 1 and seen[0] is again[-1][1]  # the fallback 'scale', as given


def test_views_are_kept_for_the_same_sources_only_where_asked() -> None:
    model = FusedLikeVllm()
    weights = _weights(0)
    kept = record_copy_plan(weights, model.load_weights)
    kept.apply(weights, model.load_weights)
    assert set(kept._views) == set(kept.copies)
    dropped = record_copy_plan(weights, model.load_weights)
    dropped.reuse_views = False
    dropped.apply(weights, model.load_weights)
    assert dropped._views == {}
