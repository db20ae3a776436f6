"""Reading a model directory's safetensors checkpoint (HF names), e.g. to perturb or re-push it."""

from __future__ import annotations

from pathlib import Path

import torch


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


def perturbed(tensors: dict[str, torch.Tensor], scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy with seeded noise added to every floating tensor: a different but valid model."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point():
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * scale * (t.float().std() + 1e-3)
            out[name] = (t.float() + noise).to(t.dtype)
        else:
            out[name] = t.clone()
    return out
