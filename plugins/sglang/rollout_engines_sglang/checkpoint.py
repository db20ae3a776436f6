"""What an update may carry, read from the model directory's safetensors headers (no tensor data)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from rollout_engines.weights.manifest import TensorSpec

SAFETENSORS_DTYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}


def read_safetensors_header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def checkpoint_specs(model_dir: str | Path, runtime_dtype: str | None = None) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor in ``model_dir/*.safetensors`` (HF checkpoint names).

    Floating tensors take ``runtime_dtype`` (the dtype the engine runs in, so the dtype a trainer
    sends). With tied word embeddings ``lm_head.weight`` is accepted too: a trainer's
    ``state_dict()`` has it, and SGLang's loader skips it because the embedding is the head.
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


def model_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}
