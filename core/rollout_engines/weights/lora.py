"""LoRA adapters as weight updates: what a LoRA push must carry, checked against the base model.

A trainer pushes an adapter with :meth:`~rollout_engines.weights.session.WeightSync.push_lora`:
the same sessions, transports, buckets and checksums as a full push, with ``manifest.lora`` set.
Its tensors are named as PEFT saves them (``base_model.model.<module>.lora_A.weight``, shape
``[rank, in_features]``; ``...lora_B.weight``, ``[out_features, rank]``), one pair for every module
of the base model whose name ends in one of ``target_modules``. Backends check an incoming adapter
with :func:`lora_expected_specs` (built from the base model's expected specs, HF names), so an
adapter that names a module the model lacks, or whose shapes do not fit, is refused before anything
is received.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import ManifestMismatch
from ..types import LoraSpec
from .manifest import ExpectedSpec, TensorSpec

PEFT_PREFIX = "base_model.model."
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def target_weights(base: Mapping[str, TensorSpec], spec: LoraSpec) -> dict[str, TensorSpec]:
    """Module name -> spec of its 2-D ``.weight``, for every module ``spec`` targets.

    Raises :class:`ManifestMismatch` when a target module matches nothing in the model."""
    found: dict[str, TensorSpec] = {}
    for name, t in base.items():
        if not name.endswith(".weight") or len(t.shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in spec.target_modules:
            found[module] = t
    missing = [m for m in spec.target_modules if not any(k.rsplit(".", 1)[-1] == m for k in found)]
    if missing:
        raise ManifestMismatch(
            f"LoRA adapter '{spec.name}' targets modules the base model lacks: {missing}; "
            "target_modules name the last component of linear layers (e.g. 'q_proj', 'v_proj')"
        )
    return found


def lora_expected_specs(base: Mapping[str, TensorSpec], spec: LoraSpec, dtype: str | torch.dtype) -> dict[str, ExpectedSpec]:
    """Name -> spec of every tensor a push of adapter ``spec`` must carry, in ``dtype`` (one of
    float32, bfloat16, float16: the adapter's own, which may differ from the model's)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in _FLOAT_DTYPES:
        raise ManifestMismatch(f"LoRA adapter '{spec.name}' tensors must be one of {_FLOAT_DTYPES}, not {dtype_name}")
    out: dict[str, ExpectedSpec] = {}
    for module, weight in target_weights(base, spec).items():
        rows, cols = weight.shape
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = ExpectedSpec(name=f"{PEFT_PREFIX}{module}.lora_A.weight",
                                                                  dtype=dtype_name, shape=(spec.rank, cols))
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = ExpectedSpec(name=f"{PEFT_PREFIX}{module}.lora_B.weight",
                                                                  dtype=dtype_name, shape=(rows, spec.rank))
    return out


def module_of(name: str) -> tuple[str, str]:
    """``base_model.model.X.lora_A.weight`` -> (``X``, ``"A"``)."""
    if not name.startswith(PEFT_PREFIX) or not name.endswith(".weight"):
        raise ManifestMismatch(f"'{name}' is not a PEFT LoRA tensor name (base_model.model.<module>.lora_A.weight)")
    stem = name[len(PEFT_PREFIX): -len(".weight")]
    module, _, which = stem.rpartition(".")
    if which not in ("lora_A", "lora_B"):
        raise ManifestMismatch(f"'{name}' is neither a lora_A nor a lora_B tensor")
    return module, which[-1]
