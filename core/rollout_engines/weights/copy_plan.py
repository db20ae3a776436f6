"""Copy plans: learn once where each checkpoint tensor lands in a model, then load by direct copies.

An engine's ``model.load_weights`` (vLLM's, SGLang's) walks every tensor through per-parameter
loaders in Python (fused qkv / gate_up slices, TP narrowing), which dominates a colocated push. But
for a given model the destinations never change. So: run ``load_weights`` once under a
``TorchDispatchMode`` that records every ``aten.copy_`` whose source is (a view of) one of the
incoming tensors, and remember, per checkpoint name, ``(destination view, source
size/stride/offset)``. Later pushes replay those copies straight from the received tensors (one
multi-tensor copy per bucket, or one CUDA graph replay once the same sources come back), no loader
code.

A name whose load did anything the recorder cannot replay (a dtype conversion, a computed value,
no copy at all) falls back to ``load_weights`` for that name; ``CopyPlan.fallback`` lists them.

:class:`PlannedLoader` is what an engine keeps per model: it records names it has not seen and
replays the ones it has (the vLLM worker extension and the SGLang loader both use it).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .copies import SteadyCopier
from .recent import Recent

logger = logging.getLogger("rollout_engines.weights.copy_plan")

#: Source views kept per name: the last two weight sets a trainer pushed (e.g. one it alternates
#: with another, as ``bench push`` does) both stay steady. Each kept set holds its tensors' memory
#: alive (views of the trainer's memory or of a reused buffer, held anyway).
VIEW_SETS = 2
#: Groups kept for :meth:`CopyPlan.replay` (a bucket each: two weight sets of a model in up to
#: 128 buckets).
MAX_GROUPS = 256


@dataclass
class _Copy:
    dst: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class CopyPlan:
    copies: dict[str, list[_Copy]] = field(default_factory=dict)
    fallback: set[str] = field(default_factory=set)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    #: Per name, the source views of the last updates' tensors (most recent first, at most
    #: :data:`VIEW_SETS`): a trainer that alternates between weight sets it keeps finds each set's
    #: views (and the copier its graphs) again.
    _views: dict[str, Recent[tuple[weakref.ref[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]] = field(
        default_factory=dict, repr=False
    )
    #: Groups of names (a bucket's) applied before with keep on, by the id of their first tensor:
    #: the group as given and its destination and source lists. The very same tensors coming back
    #: (a steady push) skip the per-name work, which for a bucket of a mixture-of-experts model
    #: (hundreds of expert tensors) costs about as long as the GPU takes to copy it.
    _groups: dict[int, tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=dict, repr=False
    )
    #: Copies a bucket's slices (``copier.use_graphs = False`` for eager copies only).
    copier: SteadyCopier = field(default_factory=SteadyCopier, repr=False)
    #: Keep each name's source views for the next updates (see :meth:`_sources`). Off where every
    #: update brings new tensors: the kept views would only hold the last updates' buffers alive
    #: (``apply(..., keep=False)`` does the same for one update).
    reuse_views: bool = True

    def covers(self, name: str, tensor: torch.Tensor) -> bool:
        want = self.shapes.get(name)
        return (
            name in self.copies and name not in self.fallback and want is not None
            and tuple(tensor.shape) == want[0] and tensor.dtype == want[1] and tensor.is_contiguous()
        )

    def apply(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], object],
        *,
        keep: bool = True,
    ) -> int:
        """Load ``named``: planned names by direct copies, the rest through ``load_weights``.
        Returns how many tensors took the fast path. ``keep=False``: the tensors are new every
        update (the caller's to give away), keep no views of them."""
        rest: list[tuple[str, torch.Tensor]] = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        fast = 0
        if not (keep and self.reuse_views):
            self._groups.clear()  # new tensors every update: what the groups hold is not coming back
        for name, tensor in named:
            if not self.covers(name, tensor):
                rest.append((name, tensor))
                continue
            d, s = self._sources(name, tensor, keep=keep and self.reuse_views)
            dsts.extend(d)
            srcs.extend(s)
            fast += 1
        with torch.no_grad():
            if dsts:
                # Replayed as a CUDA graph once the same sources come back (zero-copy transports):
                # one launch instead of hundreds.
                self.copier.copy(dsts, srcs)
        if rest:
            load_weights(rest)
        elif dsts and keep and self.reuse_views and isinstance(named, list | tuple):
            if len(self._groups) >= MAX_GROUPS:
                del self._groups[next(iter(self._groups))]  # the oldest
            self._groups[id(named[0][1])] = (list(named), dsts, srcs)
        return fast

    def replay(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Copy ``named`` if it is a group :meth:`apply` kept (the same names with the very same
        tensors, in the same order): no per-name work. False (nothing done) otherwise."""
        if not named:
            return False
        hit = self._groups.get(id(named[0][1]))
        if hit is None or len(hit[0]) != len(named):
            return False
        for (was_name, was), (name, tensor) in zip(hit[0], named, strict=True):
            if was is not tensor or was_name != name:
                return False
        with torch.no_grad():
            self.copier.copy(hit[1], hit[2])
        return True

    def _sources(self, name: str, tensor: torch.Tensor, *, keep: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The destination slices and the matching views of ``tensor``. The views are kept while the
        same tensor object comes back (zero-copy transports hand out the same view of the trainer's
        memory every update, or one per weight set the trainer alternates between), so a steady
        push builds no views at all, and the copier sees the same source objects (what lets it
        replay a graph)."""
        kept = self._views.get(name)
        hit = kept.find(lambda entry: entry[0]() is tensor) if kept is not None else None
        if hit is not None:
            return hit[1], hit[2]
        copies = self.copies[name]
        dsts = [c.dst for c in copies]
        srcs = [tensor.as_strided(c.size, c.stride, tensor.storage_offset() + c.offset) for c in copies]
        if not keep:
            self._views.pop(name, None)  # nor the last update's: what they view is not coming back
            return dsts, srcs
        try:
            entry = (weakref.ref(tensor), dsts, srcs)
        except TypeError:
            return dsts, srcs
        if kept is None:
            kept = self._views[name] = Recent(VIEW_SETS)
        kept.add(entry)
        return dsts, srcs


class _Recorder(TorchDispatchMode):
    def __init__(self, sources: dict[int, tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.sources = sources  # storage data_ptr -> (name, original tensor)
        self.copies: dict[str, list[_Copy]] = {}
        self.other_reads: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            hit = self.sources.get(_storage_ptr(src))
            if hit is not None:
                name, original = hit
                if src.dtype == dst.dtype == original.dtype and tuple(src.shape) == tuple(dst.shape):
                    self.copies.setdefault(name, []).append(
                        _Copy(dst.detach(), tuple(src.shape), tuple(src.stride()),
                              src.storage_offset() - original.storage_offset())
                    )
                else:
                    self.other_reads.add(name)
        else:
            # A source consumed by anything but a view op or copy_ (e.g. a dtype cast or arithmetic)
            # cannot be replayed as a copy: mark it.
            if not _is_view_op(func):
                for a in _flat(args) + _flat(kwargs):
                    if isinstance(a, torch.Tensor):
                        hit = self.sources.get(_storage_ptr(a))
                        if hit is not None:
                            self.other_reads.add(hit[0])
        return func(*args, **kwargs)


def _flat(x: object) -> list[object]:
    if isinstance(x, dict):
        return [v for item in x.values() for v in _flat(item)]
    if isinstance(x, list | tuple):
        return [v for item in x for v in _flat(item)]
    return [x]


def _is_view_op(func: object) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    returns = schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


def record_copy_plan(
    named: Sequence[tuple[str, torch.Tensor]],
    load_weights: Callable[[list[tuple[str, torch.Tensor]]], object],
) -> CopyPlan:
    """Load ``named`` through ``load_weights`` once (for real) while recording where each tensor goes.

    ``named`` tensors must not share storage with each other (clone them if they do). The plan is
    of contiguous sources (what :meth:`CopyPlan.covers` replays): a tensor laid out otherwise (a
    transposed or strided view) is loaded from a contiguous copy, so the recorded source strides and
    offsets are those of any contiguous tensor of its shape."""
    named = [(n, t if t.is_contiguous() else t.contiguous()) for n, t in named]
    sources: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in named:
        ptr = _storage_ptr(tensor)
        if ptr in sources:
            raise ValueError(f"'{name}' shares storage with '{sources[ptr][0]}'; pass separate tensors")
        sources[ptr] = (name, tensor)
    recorder = _Recorder(sources)
    with recorder:
        load_weights(list(named))
    plan = CopyPlan()
    for name, tensor in named:
        plan.shapes[name] = (tuple(tensor.shape), tensor.dtype)
        if name in recorder.copies and name not in recorder.other_reads:
            plan.copies[name] = recorder.copies[name]
        else:
            plan.fallback.add(name)
    logger.info("copy plan: %d tensors by direct copy, %d through load_weights", len(plan.copies), len(plan.fallback))
    return plan


class PlannedLoader:
    """Loads named tensors into one model through its ``load_weights``, by a :class:`CopyPlan`.

    Names seen for the first time are loaded for real while the plan records where they land;
    names seen before are replayed by direct copies (or go through ``load_weights`` again where the
    plan cannot replay them, see :attr:`CopyPlan.fallback`). Keep one per model: the plan holds
    views of that model's parameters.
    """

    def __init__(self, plan: CopyPlan | None = None) -> None:
        self.plan = plan if plan is not None else CopyPlan()

    def forget_sources(self) -> None:
        """Drop the source views kept for the next update (and the copies captured over them): what
        they view is about to be freed."""
        self.plan._views.clear()
        self.plan._groups.clear()
        self.plan.copier.forget()

    def apply(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], object],
        *,
        owned: bool,
    ) -> None:
        """Load ``named``. ``owned``: the tensors are the caller's to give away; otherwise they are
        views (of a transport slot, of the trainer's memory) that change after this call, so any
        that reach ``load_weights`` are cloned first (a model's loaders may keep what they get)."""
        plan = self.plan
        if not owned and plan.replay(named):
            return
        new = [(n, t) for n, t in named if n not in plan.shapes]
        known = [(n, t) for n, t in named if n in plan.shapes]
        if not owned:
            known = [(n, t if plan.covers(n, t) else t.clone()) for n, t in known]
        if new:
            # Learn where these names land by loading them once for real. The recorder tells
            # tensors apart by storage and bucket views share one, so they are copied first.
            learned = record_copy_plan([(n, t.clone(memory_format=torch.contiguous_format)) for n, t in new],
                                       load_weights)
            plan.copies.update(learned.copies)
            plan.fallback |= learned.fallback
            plan.shapes.update(learned.shapes)
        if known:
            # Owned tensors are new every update (fresh buckets, staged clones): views of them kept
            # for the next update would hold a whole update's memory alive in between.
            plan.apply(known, load_weights, keep=not owned)
