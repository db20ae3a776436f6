"""Option ``pack_weights``: the model's weights in one sleep-mode allocation instead of hundreds.

With sleep mode, vLLM's ``CuMemAllocator`` backs every memory block the weights take with its own
CUDA virtual-memory allocation, and a level-2 wake-up gives each its memory back with
``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``, one after another (163 allocations for a
Qwen3-14B shape: ~52 ms of driver calls on an H200, the larger part of a refit; see
``benchmarks/vmm_wake.py``). Every parameter is a block carved by PyTorch's caching allocator
from the segments that allocator asked for; a segment that is free again goes back to the pool it
came from, and the next blocks are carved from it.

So this loader, registered with vLLM as load format :data:`LOAD_FORMAT` (vLLM's
``register_model_loader``), allocates and frees one tensor as large as the checkpoint's weights
in the model's dtype right before vLLM builds the model, inside vLLM's ``weights`` memory pool.
The parameters are then carved from that one segment; the few small ones (norms, biases) share
PyTorch's 2 MiB small-block segments as before. It loads like vLLM's default loader otherwise.

The reservation is a little short of the estimate (:data:`RESERVE_FRACTION`): tensors that do not
fit take segments of their own, as they did without the option, while an estimate above what the
model takes would keep memory unused inside the weights' allocation for the engine's life. What
the pool holds after loading is reported by the workers (``info().extra['workers']``).
Only where it matters: CUDA, sleep mode on (vLLM's pool active while the model is built).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("rollout_engines.vllm.worker")

#: vLLM load format the option ``pack_weights`` selects (registered when a worker imports the
#: extension: :func:`register`).
LOAD_FORMAT = "rollout_engines_packed"
#: The share of the estimated weight bytes reserved: parameters beyond it take segments of their
#: own, where reserving more than the model takes would waste the rest.
RESERVE_FRACTION = 0.99
#: PyTorch's caching allocator rounds large segments to this.
SEGMENT_ROUND = 2 << 20
#: Tensors up to this size come from the small-block pool, not from the reserved segment.
SMALL_TENSOR = 1 << 20

#: What the last load reserved, for the worker's info (one model per worker process).
LAST_LOAD: dict[str, Any] = {}


def weight_bytes(model_dir: str | Path, dtype: torch.dtype) -> int:
    """The bytes the checkpoint's weights take as the model's parameters: every floating tensor
    larger than :data:`SMALL_TENSOR` in ``dtype`` (the others in their own), a tied LM head not
    counted twice. Read from the safetensors headers only."""
    from rollout_engines.weights.checkpoint import read_safetensors_header

    model_dir = Path(model_dir)
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    text = config.get("text_config", config)
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
             "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, meta in read_safetensors_header(file).items():
            if tied and name == "lm_head.weight":
                continue  # vLLM's loader skips it: the embedding is the head
            numel = 1
            for dim in meta["shape"]:
                numel *= int(dim)
            own = sizes.get(meta["dtype"], 1)
            nbytes = numel * (itemsize if meta["dtype"] in ("F64", "F32", "F16", "BF16") else own)
            if nbytes > SMALL_TENSOR:
                total += nbytes
    return total


def reservation_bytes(model_dir: str | Path, dtype: torch.dtype, fraction: float = RESERVE_FRACTION) -> int:
    """What :class:`PackedLoader` reserves for ``model_dir``'s weights: ``fraction`` of
    :func:`weight_bytes`, rounded down to whole allocator segments."""
    return int(weight_bytes(model_dir, dtype) * fraction) // SEGMENT_ROUND * SEGMENT_ROUND


def _cumem_pool_tag() -> str | None:
    """The tag of vLLM's sleep-mode memory pool active in this thread (None: none is)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:  # noqa: BLE001 - no cumem allocator in this build (CPU)
        return None
    instance = CuMemAllocator.instance
    if instance is None or not instance.allocator_and_pools:
        return None
    return str(instance.current_tag)


def pool_allocations(tag: str = "weights") -> dict[str, int] | None:
    """How many sleep-mode allocations with ``tag`` vLLM holds in this process, and their bytes
    (None without sleep mode)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:  # noqa: BLE001
        return None
    instance = CuMemAllocator.instance
    if instance is None:
        return None
    sizes = [int(d.handle[1]) for d in instance.pointer_to_data.values() if d.tag == tag]
    return {"count": len(sizes), "bytes": sum(sizes), "largest": max(sizes, default=0)}


def register() -> None:
    """Register :class:`PackedLoader` with vLLM as :data:`LOAD_FORMAT` (once per process)."""
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    registry = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    if LOAD_FORMAT in registry:
        return

    class PackedLoader(DefaultModelLoader):
        """vLLM's default loader, with the weights' segment reserved first (module docstring)."""

        def __init__(self, load_config: Any) -> None:
            own = copy.copy(load_config)
            own.load_format = "auto"  # the default loader picks the checkpoint's files by it
            super().__init__(own)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            reserved = 0
            tag = _cumem_pool_tag()
            device = vllm_config.device_config.device
            if tag == "weights" and torch.device(device).type == "cuda":
                from .checkpoint import resolve_model_dir

                reserved = reservation_bytes(resolve_model_dir(model_config.model), model_config.dtype)
                if reserved > 0:
                    block = torch.empty(reserved, dtype=torch.uint8, device=device)
                    del block  # back to the pool: the parameters are carved from this segment
            else:
                logger.info("pack_weights: nothing to pack here (%s, sleep-mode pool %s): loading as usual",
                            device, tag)
            model = super().load_model(vllm_config, model_config, prefix)
            LAST_LOAD.clear()
            LAST_LOAD["reserved_bytes"] = reserved
            return model

    model_loader.register_model_loader(LOAD_FORMAT)(PackedLoader)
