"""LoRA adapters for the embedded engine: low-rank hooks on the model's linear layers, per row.

The engine batches requests of different callers, so one forward pass may mix rows of several
adapters and rows of the base model. Each targeted ``nn.Linear`` gets a forward hook that adds
``scaling * (x A^T) B^T`` to the output rows of the adapter's requests only (``index_add_`` on
those rows; the whole output when every row uses it). When no row of a forward uses an adapter the
hook returns at once and the output is the base model's, bit for bit; hooks are removed once no
adapter is installed and no running row holds one.

An :class:`Adapter` is immutable: installing a new version puts a new object in
:attr:`LoraLayers.adapters` (one dict entry, swapped between two steps). A row takes the adapter
object when it is admitted and keeps it until it finishes, so a completion is made by exactly one
adapter version (``Completion.lora_version``), even if that adapter is replaced or unloaded while
it runs. Hooks are only added or removed on the engine's worker thread, between two forwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...weights.lora import split_adapter
from ...weights.manifest import TensorSpec


@dataclass(frozen=True, eq=False)
class Adapter:
    """One loaded version of a LoRA adapter: per module name, ``(A, B)`` in the model's dtype and
    on its device."""

    name: str
    version: int
    scaling: float
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]


class LoraLayers:
    """The adapters of one model and the hooks that apply them (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.linears: dict[str, torch.nn.Linear] = {
            name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        #: name -> the version requests admitted from now on get.
        self.adapters: dict[str, Adapter] = {}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        #: During one forward: (adapter, its batch rows or None for all rows).
        self._active: list[tuple[Adapter, torch.Tensor | None]] | None = None

    def base_specs(self) -> dict[str, TensorSpec]:
        """The weights an adapter may target: those of the model's linear layers (HF names)."""
        return {
            f"{name}.weight": TensorSpec(name=f"{name}.weight", dtype=str(m.weight.dtype).removeprefix("torch."),
                                         shape=tuple(m.weight.shape))
            for name, m in self.linears.items()
        }

    def build(self, name: str, version: int, scaling: float, tensors: Mapping[str, torch.Tensor]) -> Adapter:
        """An adapter from its received PEFT-named tensors, moved to each layer's device and dtype."""
        weights = {}
        for module, (a, b) in split_adapter(tensors).items():
            w = self.linears[module].weight
            weights[module] = (a.to(w.device, w.dtype).contiguous(), b.to(w.device, w.dtype).contiguous())
        return Adapter(name=name, version=version, scaling=scaling, weights=weights)

    # ---- hooks (worker thread only) ----------------------------------------------------------------
    @property
    def hooked(self) -> bool:
        return bool(self._hooks)

    def attach(self, adapters: Iterable[Adapter | None]) -> None:
        """Hook every layer these adapters adapt (rows holding them are about to run)."""
        for adapter in adapters:
            if adapter is None:
                continue
            for module in adapter.weights:
                if module not in self._hooks:
                    self._hooks[module] = self.linears[module].register_forward_hook(self._hook(module))

    def detach_all(self) -> None:
        """Remove every hook (no adapter installed, no running row holds one)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def _hook(self, module: str) -> Any:
        def hook(layer: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
            active = self._active
            if not active:
                return None  # the base model's output, untouched
            x = args[0]
            for adapter, rows in active:
                ab = adapter.weights.get(module)
                if ab is None:
                    continue
                a, b = ab
                if rows is None:
                    output.add_((x @ a.T) @ b.T, alpha=adapter.scaling)
                else:
                    output.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T, alpha=adapter.scaling)
            return output

        return hook

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[Adapter | None]) -> Iterator[None]:
        """One forward over a batch whose row ``i`` uses ``adapters[i]`` (None: the base model)."""
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for i, adapter in enumerate(adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(i)
        if not groups:
            yield
            return
        self._active = [
            (adapter, None if len(idx) == len(adapters) else torch.tensor(idx, device=self.device, dtype=torch.long))
            for adapter, idx in groups.values()
        ]
        try:
            yield
        finally:
            self._active = None


__all__ = ["Adapter", "LoraLayers"]
