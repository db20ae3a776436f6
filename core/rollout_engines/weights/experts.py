"""Checkpoint names for models whose experts transformers fuses on load (transformers 5 MoE).

A Qwen3-MoE (Qwen2-MoE, DeepSeek, OLMoE, ...) checkpoint stores every expert's projections under
its own name (``mlp.experts.<e>.gate_proj.weight``, ``up_proj``, ``down_proj``), and vLLM and
SGLang load them by those names. transformers 5 fuses them while loading into one parameter per
layer and kind (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``), as its
conversion mapping says (a ``WeightConverter`` that merges the experts along a new first dim and
concatenates gate and up). Each checkpoint tensor is then a contiguous slice of a fused
parameter: :func:`expert_aliases` says which, :func:`checkpoint_named` hands a trainer's model
over under the checkpoint's names (views: no copy, zero-copy transports share the parameters),
and the embedded engine's :class:`~.receiver.StateDictTarget` receives those names into the
slices.

Only converters made of ``MergeModulelist(dim=0)``, optionally followed by ``Concatenate(dim=1)``,
are understood here; the result is checked against transformers' own reverse conversion (run on
meta tensors: names and shapes, no memory). A model converted any other way keeps its
parameters' names (``expert_aliases`` returns ``None``).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("rollout_engines.weights")

_UNDERSTOOD = ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


@dataclass(frozen=True)
class ExpertSlice:
    """Where one checkpoint tensor lies: expert ``expert`` of the fused parameter ``param``, and of
    that, part ``part`` of ``parts`` equal parts along its first dim (gate, up)."""

    param: str
    expert: int
    part: int = 0
    parts: int = 1

    def of(self, fused: torch.Tensor) -> torch.Tensor:
        """The slice of ``fused`` (the parameter ``param``): a contiguous view."""
        one = fused[self.expert]
        if self.parts == 1:
            return one
        size = one.shape[0] // self.parts
        return one[self.part * size : (self.part + 1) * size]


def expert_aliases(model: torch.nn.Module) -> dict[str, ExpertSlice] | None:
    """Checkpoint name -> :class:`ExpertSlice`, for every tensor a transformers model fuses on load;
    ``None`` when it fuses nothing, is not a transformers model, or fuses in a way not understood
    here (see the module's notes)."""
    if not hasattr(model, "config"):  # checked first: importing transformers takes ~1 s
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, revert_weight_conversion
    except ImportError:  # transformers < 5: nothing is fused
        return None
    hf: Any = model  # a transformers PreTrainedModel
    try:
        conversions = getattr(hf, "_weight_conversions", None) or get_model_conversion_mapping(hf, add_legacy=False)
    except Exception:  # noqa: BLE001 - a model transformers has no mapping for
        return None
    state = model.state_dict(keep_vars=True)
    aliases: dict[str, ExpertSlice] = {}
    for conv in conversions or ():
        if not isinstance(conv, WeightConverter):
            continue
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in conv.operations]
        sources, targets = list(conv.source_patterns), list(conv.target_patterns)
        if ops not in _UNDERSTOOD or len(targets) != 1 or (len(ops) == 1) != (len(sources) == 1):
            logger.info("transformers converts %s in a way not mapped here; keeping fused names", targets)
            return None
        target = targets[0]
        for name, fused in state.items():
            if not (name == target or name.endswith("." + target)):
                continue
            prefix = name[: len(name) - len(target)]
            for expert in range(fused.shape[0]):
                for part, pattern in enumerate(sources):
                    aliases[prefix + pattern.replace("*", str(expert), 1)] = ExpertSlice(name, expert, part, len(sources))
    if not aliases:
        return None
    # transformers' own answer, on meta tensors (names and shapes only): ours must be the same.
    meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in state.items()}
    try:
        theirs = {n: tuple(t.shape) for n, t in revert_weight_conversion(hf, meta).items()}
    except Exception as exc:  # noqa: BLE001
        logger.info("transformers' reverse conversion failed (%s); keeping fused names", exc)
        return None
    fused_names = {a.param for a in aliases.values()}
    ours = {n: tuple(t.shape) for n, t in state.items() if n not in fused_names}
    ours.update({n: tuple(a.of(meta[a.param]).shape) for n, a in aliases.items()})
    if ours != theirs:
        logger.info("fused expert names do not match transformers' reverse conversion; keeping fused names")
        return None
    return aliases


def checkpoint_named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under the names its checkpoint uses: its state dict, with each fused
    expert parameter (transformers 5 MoE) given as one view per expert and projection. What
    vLLM and SGLang engines expect from a trainer that holds the model in transformers 5:

        await sync.push(checkpoint_named(model), version=step)

    Every tensor is a detached view of the model's own memory (nothing is copied), and the same
    tensor objects come back on every call while the parameters stay where they are (an optimizer
    updates them in place): a zero-copy ``cuda_ipc`` push then reuses its descriptions of them.
    For a model that fuses nothing this is the state dict's tensors."""
    aliases = _aliases_of(model)
    state = model.state_dict(keep_vars=True)
    kept = _VIEWS.setdefault(model, {})

    def view(name: str, source: torch.Tensor, make: Any) -> torch.Tensor:
        hit = kept.get(name)
        if hit is not None and hit[0] is source and hit[1] == source.data_ptr():
            return hit[2]
        out = make(source.detach())
        kept[name] = (source, source.data_ptr(), out)
        return out

    fused = {a.param for a in aliases.values()} if aliases else set()
    named = {n: view(n, t, lambda d: d) for n, t in state.items() if n not in fused}
    for n, a in (aliases or {}).items():
        named[n] = view(n, state[a.param], a.of)
    return named


#: Per model: its aliases (computed once: the model's structure does not change), and the views
#: :func:`checkpoint_named` handed out, by name, with the tensor and address each was made from.
_ALIASES: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, ExpertSlice] | None] = weakref.WeakKeyDictionary()
_VIEWS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[torch.Tensor, int, torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)


def _aliases_of(model: torch.nn.Module) -> dict[str, ExpertSlice] | None:
    if model not in _ALIASES:
        _ALIASES[model] = expert_aliases(model)
    return _ALIASES[model]


def alias_specs(aliases: dict[str, ExpertSlice], state: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each aliased checkpoint tensor."""
    return {n: (tuple(a.of(state[a.param]).shape), state[a.param].dtype) for n, a in aliases.items()}


__all__ = ["ExpertSlice", "alias_specs", "checkpoint_named", "expert_aliases"]
