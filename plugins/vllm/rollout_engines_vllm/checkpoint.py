"""What a vLLM model accepts in a weight update, read from its checkpoint (HF names).

vLLM fuses and repacks parameters (``qkv_proj``, ``gate_up_proj``; on CPU the linear weights are
repacked for oneDNN and the original parameters emptied), so the running model's own parameters
cannot say which tensors an update may carry. The checkpoint can: the safetensors headers give
every HF name and shape without reading any data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

from rollout_engines.weights.manifest import TensorSpec

#: safetensors header dtype -> torch dtype name.
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16"}


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


def read_safetensors_header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def checkpoint_specs(model_dir: str | Path, runtime_dtype: str | None = None) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor in ``model_dir/*.safetensors``.

    Floating tensors take ``runtime_dtype`` (the dtype the engine runs in, and so the dtype a
    trainer sends); with tied word embeddings ``lm_head.weight`` is accepted too (a trainer's
    ``state_dict()`` has it; vLLM's loader ignores it because the embedding is the head).
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}; weight updates need a safetensors checkpoint to know "
            "which tensors the model takes"
        )
    specs: dict[str, TensorSpec] = {}
    for file in files:
        for name, meta in read_safetensors_header(file).items():
            dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
            if dtype is None:
                continue  # a dtype no update can carry; validation reports the name as unknown
            if runtime_dtype is not None and dtype in FLOAT_DTYPES:
                dtype = runtime_dtype
            specs[name] = TensorSpec(name=name, dtype=dtype, shape=tuple(meta["shape"]))
    config_file = model_dir / "config.json"
    if config_file.exists():
        config = json.loads(config_file.read_text())
        text_config = config.get("text_config", config)
        tied = text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        embed = specs.get("model.embed_tokens.weight")
        if tied and embed is not None and "lm_head.weight" not in specs:
            specs["lm_head.weight"] = TensorSpec(name="lm_head.weight", dtype=embed.dtype, shape=embed.shape)
    return specs


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
