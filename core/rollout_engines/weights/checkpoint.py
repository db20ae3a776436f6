"""Reading a model directory's safetensors checkpoint (HF names): what an update may carry
(from the headers alone, no tensor data), and the tensors themselves (to perturb or re-push)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .manifest import ExpectedSpec, TensorSpec

if TYPE_CHECKING:
    import torch

#: safetensors header dtype -> torch dtype name.
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16"}


def read_safetensors_header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def checkpoint_specs(model_dir: str | Path, runtime_dtype: str | None = None) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor in ``model_dir/*.safetensors`` (HF checkpoint names).

    Engines that fuse or repack parameters (vLLM, SGLang) cannot say from their own parameters
    which tensors an update may carry; the checkpoint's headers can. Floating tensors take
    ``runtime_dtype`` (the dtype the engine runs in, so the dtype a trainer sends). With tied word
    embeddings ``lm_head.weight`` is accepted too: a trainer's ``state_dict()`` has it, and the
    engines' loaders skip it because the embedding is the head.
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
            # The same parameter under a second name: a complete push may carry either.
            specs["lm_head.weight"] = ExpectedSpec(
                name="lm_head.weight", dtype=embed.dtype, shape=embed.shape, tied_to=("model.embed_tokens.weight",)
            )
            specs["model.embed_tokens.weight"] = ExpectedSpec(**embed.model_dump(), tied_to=("lm_head.weight",))
    return specs


def load_checkpoint(model_path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of ``model_path/*.safetensors`` by HF name (optionally cast to ``dtype``)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}; pass a local model directory")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    if dtype is not None:
        out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
    return out


def perturbed(tensors: dict[str, torch.Tensor], scale: float = 0.5, seed: int = 1,
              place: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A copy with seeded noise added to every floating tensor: a different but valid model. The
    noise is drawn on each tensor's device (a GPU perturbs a 14B-shape state in seconds; the CPU
    takes minutes), so the same seed gives different noise on different devices. ``place`` moves
    each result as soon as it is made (e.g. into host memory: the copy then never needs a second
    state's room on the device)."""
    import torch
    gens: dict[torch.device, torch.Generator] = {}
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point():
            gen = gens.get(t.device)
            if gen is None:
                gen = gens[t.device] = torch.Generator(device=t.device).manual_seed(seed)
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32, device=t.device)
            made = (t.float() + noise.mul_(scale * (t.float().std() + 1e-3))).to(t.dtype)
            del noise
        else:
            made = t.clone()
        out[name] = made if place is None else place(made)
    return out


@contextmanager
def atomic_directory(path: str | Path, *, replace: bool = False) -> Iterator[Path]:
    """Write a directory all at once: yields an empty temporary sibling of ``path`` (mode 0700) to
    write into; when the block ends without an error it is renamed to ``path``, else removed.
    ``path`` must be absent or empty, unless ``replace``: then a directory already there is swapped
    out and removed. Readers never see a half-written directory."""
    import os
    import shutil
    import tempfile

    final = Path(path).expanduser().resolve()
    if not replace and final.exists() and any(final.iterdir()):
        raise FileExistsError(f"{final} exists and is not empty")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists() and replace:  # a directory is renamed only onto an empty one
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        elif final.exists():
            final.rmdir()  # OSError if something was written there meanwhile: that is kept
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
