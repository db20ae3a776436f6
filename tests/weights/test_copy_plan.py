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


def test_two_alternating_weight_sets_both_keep_their_views() -> None:
    """A trainer that alternates between two weight sets it keeps (``bench push`` does) finds
    each set's source views again: the copier sees the same source objects every other update,
    which is what lets it replay a graph per set on a GPU."""
    model = FusedLikeVllm()
    plan = record_copy_plan(_weights(0), model.load_weights)
    sets = [_weights(1), _weights(2)]
    seen: list[list[int]] = []
    copy = plan.copier.copy

    def spy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        seen.append([id(s) for s in srcs])
        copy(dsts, srcs)

    plan.copier.copy = spy  # type: ignore[method-assign]
    for step in range(4):
        plan.apply(sets[step % 2], model.load_weights)
        for (name, t), (_, p) in zip(sets[step % 2][:3], [("q", model.qkv[i * 8 : (i + 1) * 8]) for i in range(3)], strict=True):
            assert torch.equal(t, p), (step, name)
    assert seen[2] == seen[0] and seen[3] == seen[1] and seen[0] != seen[1]
    third = _weights(3)  # a third set pushes out the least recent one
    plan.apply(third, model.load_weights)
    plan.apply(sets[0], model.load_weights)
    assert seen[-1] != seen[0]


def test_owned_tensors_are_not_held_after_the_update() -> None:
    """Tensors handed over as the receiver's own (fresh buckets, staged clones) are new every
    update: the loader keeps no views of them, so their memory (a whole update's, staged) is freed
    as soon as the caller lets go."""
    import gc
    import weakref

    model = FusedLikeVllm()
    loader = PlannedLoader()
    loader.apply(_weights(0), model.load_weights, owned=True)  # learns the plan
    update = _weights(1)
    refs = [weakref.ref(t) for _, t in update]
    loader.apply(update, model.load_weights, owned=True)
    assert torch.equal(model.embed, update[5][1])
    del update
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    # Views handed over (not owned) are kept for the next update.
    views = _bucket_views(_weights(2))
    loader.apply(views, model.load_weights, owned=False)
    assert set(loader.plan._views) == set(loader.plan.copies)


def test_alternating_weight_sets_each_replay_their_own_graph() -> None:
    """On a GPU: sets A and B pushed in turn are each captured on their second update and
    replayed from then on, and every update lands exactly."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reference, planned = FusedLikeVllm().cuda(), FusedLikeVllm().cuda()
    plan = record_copy_plan([(n, t.cuda()) for n, t in _weights(0)], planned.load_weights)
    sets = [[(n, t.cuda()) for n, t in _weights(s) if n != "scale"] for s in (1, 2)]
    for step in range(6):
        plan.apply(sets[step % 2], planned.load_weights)
        reference.load_weights(sets[step % 2])
        torch.cuda.synchronize()
        for (name, a), b in zip(planned.named_parameters(), reference.parameters(), strict=True):
            if name != "scale":
                assert torch.equal(a, b), (step, name)
    # A and B eager on their first sight, captured on the second (steps 2, 3), replayed after.
    assert plan.copier.replays == 4


def test_a_group_seen_before_with_the_same_tensors_skips_the_per_name_work() -> None:
    """The same bucket views coming back (a steady push) are copied as the group kept the last
    time, without looking at each name again; the trainer's in-place changes land; one new tensor
    object in the group makes it go the per-name way again, and land too."""
    reference, planned = FusedLikeVllm(), FusedLikeVllm()
    loader = PlannedLoader()
    loader.apply(_weights(0), planned.load_weights, owned=True)
    views = [(n, t) for n, t in _bucket_views(_weights(1)) if n != "scale"]
    per_name: list[str] = []
    sources = loader.plan._sources

    def counting(name, tensor, *, keep):  # type: ignore[no-untyped-def]
        per_name.append(name)
        return sources(name, tensor, keep=keep)

    loader.plan._sources = counting  # type: ignore[method-assign]
    for step in range(3):
        per_name.clear()
        for _, t in views:
            t.add_(1.0)  # the trainer's step, in place
        loader.apply(views, planned.load_weights, owned=False)
        reference.load_weights(views)
        for (name, a), b in zip(planned.named_parameters(), reference.parameters(), strict=True):
            if name != "scale":
                assert torch.equal(a, b), (step, name)
        assert len(per_name) == (6 if step == 0 else 0), step
    views[2] = (views[2][0], views[2][1].clone() * 3)  # a new object for 'v'
    per_name.clear()
    loader.apply(views, planned.load_weights, owned=False)
    reference.load_weights(views)
    assert len(per_name) == 6
    assert torch.equal(planned.qkv, reference.qkv)
