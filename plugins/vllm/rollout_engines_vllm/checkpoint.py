"""What a vLLM model accepts in a weight update, read from its checkpoint (HF names).

vLLM fuses and repacks parameters (``qkv_proj``, ``gate_up_proj``; on CPU the linear weights are
repacked for oneDNN and the original parameters emptied), so the running model's own parameters
cannot say which tensors an update may carry. The checkpoint can: the safetensors headers give
every HF name and shape without reading any data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from rollout_engines.weights.checkpoint import checkpoint_specs

__all__ = ["checkpoint_specs", "incomplete_groups", "module_groups", "resolve_model_dir"]

def resolve_model_dir(model: str) -> Path:
    """A local directory for ``model`` (a path, or a hub id already in the local cache)."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as exc:
        raise FileNotFoundError(
            f"model '{model}' is neither a local directory nor in the local hub cache ({exc}); "
            "weight updates need the checkpoint's tensor names: pass a local model directory"
        ) from exc


def module_groups(names: Iterable[str], packed_modules_mapping: Mapping[str, list[str]]) -> dict[str, set[str]]:
    """Checkpoint names grouped by the vLLM module that receives them.

    ``q_proj``/``k_proj``/``v_proj`` (weights and biases) land in one ``qkv_proj`` module, and a
    module is processed once all of its tensors arrived. Loading part of a module's tensors
    leaves the rest undefined, so an update must carry all of a group or none of it.
    """
    sub_to_packed = {sub: packed for packed, subs in packed_modules_mapping.items() for sub in subs}
    groups: dict[str, set[str]] = {}
    for name in names:
        module, _, _param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in sub_to_packed:
            module = f"{parent}.{sub_to_packed[leaf]}" if parent else sub_to_packed[leaf]
        groups.setdefault(module, set()).add(name)
    return groups


def incomplete_groups(
    sent: Iterable[str], expected: Iterable[str], packed_modules_mapping: Mapping[str, list[str]]
) -> list[str]:
    """Problems for every module of which an update carries some tensors but not all."""
    sent = set(sent)
    problems = []
    for module, members in sorted(module_groups(expected, packed_modules_mapping).items()):
        got = members & sent
        if got and got != members:
            problems.append(f"module '{module}' needs {sorted(members - got)} with {sorted(got)}")
    return problems
