"""FP8 block quantization of checkpoint weights: the format of Qwen3 and DeepSeek FP8 checkpoints.

An engine can serve an FP8 copy of the model the trainer trains in BF16. The format, as vLLM's
``Fp8Config`` loads it (``quant_method: fp8``, ``weight_block_size: [128, 128]``):

- every quantized tensor ``x.weight`` (``[N, K]``) is stored as ``float8_e4m3fn`` ``[N, K]`` next to
  ``x.weight_scale_inv``, ``float32`` ``[ceil(N/128), ceil(K/128)]``;
- block ``(i, j)`` dequantizes as ``weight[i*128:(i+1)*128, j*128:(j+1)*128] * scale_inv[i, j]``;
  ``scale_inv`` is the block's absolute maximum over 448 (the largest e4m3 value), so the largest
  element of a block maps to ±448. Edge blocks (``N`` or ``K`` not a multiple of 128) take the
  maximum over the elements that exist, as DeepSeek's and vLLM's quantizers do;
- quantized: the 2-D weights of the decoder layers' projections (:func:`is_fp8_quantized`);
  embeddings, the LM head, norms and biases stay in the model's dtype.

Error bound (tested): e4m3 keeps 3 mantissa bits, so rounding a scaled value ``y`` (``|y| <= 448``)
costs at most ``|y| * 2**-4`` for normal values and ``2**-10`` (half the subnormal step) below
``2**-6``. Per element of a block with maximum ``amax``: ``|dequant(q) - w| <= |w| * 2**-4 +
amax * 2**-10 / 448``, hence at most ``amax / 16``.

Pure torch (CPU and CUDA). Pushes into an FP8 engine quantize either here, on the trainer
(``WeightSync.push(..., quantize="fp8_block")``), or in the engine's workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch

from .checkpoint import atomic_directory, checkpoint_specs
from .manifest import TensorSpec

#: What ``WeightSync.push(quantize=...)`` and the engines' options name this format.
Quantization = Literal["fp8_block"]
BLOCK = (128, 128)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
#: Floor of a block's absolute maximum: an all-zero block gets a tiny, finite, positive scale.
AMAX_FLOOR = 1e-12
#: The suffix vLLM (and DeepSeek / Qwen3 FP8 checkpoints) give a weight's block scales.
SCALE_SUFFIX = "_scale_inv"
#: ``config.json``'s ``quantization_config`` for the format.
QUANTIZATION_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
}
#: Bump when the written files change, so cached copies are rebuilt.
FORMAT_VERSION = "2"  # 2: scales by IEEE division on CUDA too (see quantize_fp8_block)
CACHE_ENV = "ROLLOUT_ENGINES_CACHE"

_QUANTIZED = re.compile(
    r"(^|\.)layers\.\d+\.(.+\.)?(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
)


def is_fp8_quantized(name: str, shape: Sequence[int] | None = None) -> bool:
    """Whether checkpoint tensor ``name`` is quantized in the FP8 copy: the 2-D ``weight`` of a
    decoder layer's attention or MLP projection (``q/k/v/o_proj``, ``gate/up/down_proj``); never an
    embedding, the LM head, a norm or a bias."""
    if _QUANTIZED.search(name) is None:
        return False
    return shape is None or len(shape) == 2


def scale_name(name: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv``."""
    return name + SCALE_SUFFIX


def scale_shape(shape: Sequence[int], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    n, k = shape
    return (-(-n // block[0]), -(-k // block[1]))


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (2-D, any float dtype) -> ``(q, scale_inv)``: ``q`` float8_e4m3fn of ``w``'s shape,
    ``scale_inv`` float32 ``[ceil(N/bn), ceil(K/bk)]``, on ``w``'s device.

    The arithmetic is float32 (the block maxima, ``scale_inv = amax / 448`` by IEEE division on
    every device, ``w / scale_inv`` rounded to e4m3), without a float32 copy of the weights:
    ``|w|`` and its block maxima are exact in bf16/fp16, and the division promotes each element to
    float32 as it goes (fewer passes over memory, the same bits as quantizing ``w.float()``)."""
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantization takes 2-D weights, not shape {list(w.shape)}")
    n, k = w.shape
    bn, bk = block
    nb, kb = scale_shape((n, k), block)
    x = w.detach()
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x = x.float()  # float64 (and integers) round to float32 first, as the format's arithmetic is float32
    if (n, k) != (nb * bn, kb * bk):  # zeros do not change a block's absolute maximum
        x = torch.nn.functional.pad(x, (0, kb * bk - k, 0, nb * bn - n))
    blocks = x.contiguous().view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3)).float().clamp_(min=AMAX_FLOOR)
    # A tensor divisor, not the Python float: CUDA divides by a CPU scalar as a multiplication by
    # its float32 reciprocal, one bit off the quotient for some maxima, and the scales would then
    # depend on the device that quantized (the Triton quantizer in the vLLM workers, the CPU and
    # this path on a GPU must agree bit for bit, or a push of the same weights changes them).
    scale_inv = torch.div(amax, amax.new_full((), FP8_MAX))
    q = torch.div(blocks, scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(nb * bn, kb * bk)
    if (n, k) != (nb * bn, kb * bk):
        q = q[:n, :k].contiguous()
    return q, scale_inv


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weights ``q`` and ``scale_inv`` stand for, in ``dtype``."""
    n, k = q.shape
    if tuple(scale_inv.shape) != scale_shape((n, k), block):
        raise ValueError(f"scale_inv {list(scale_inv.shape)} does not fit weight {[n, k]} in blocks {list(block)}")
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (q.float() * s).to(dtype)


def quantize_named(
    items: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] = BLOCK
) -> Iterator[tuple[str, torch.Tensor]]:
    """A BF16 named-tensor stream in FP8 checkpoint form: each quantized ``x.weight`` becomes
    ``x.weight`` (float8_e4m3fn) then ``x.weight_scale_inv`` (float32), computed on the tensor's own
    device one at a time (lazy: a generator in, a generator out); other tensors pass unchanged."""
    for name, tensor in items:
        if is_fp8_quantized(name, tensor.shape) and tensor.is_floating_point() and tensor.dtype != FP8_DTYPE:
            q, s = quantize_fp8_block(tensor.detach(), block)
            yield name, q
            yield scale_name(name), s
        else:
            yield name, tensor


def quantized_specs(specs: Iterable[TensorSpec], block: tuple[int, int] = BLOCK) -> list[TensorSpec]:
    """The specs of :func:`quantize_named`'s output for tensors of ``specs`` (same order)."""
    out: list[TensorSpec] = []
    for spec in specs:
        if is_fp8_quantized(spec.name, spec.shape):
            out.append(spec.model_copy(update={"dtype": "float8_e4m3fn"}))
            out.append(TensorSpec(name=scale_name(spec.name), dtype="float32", shape=scale_shape(spec.shape, block)))
        else:
            out.append(spec)
    return out


def spec_forms(
    fp8_specs: Mapping[str, TensorSpec], runtime_dtype: str
) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
    """From an FP8 checkpoint's specs (as stored): what a push into an engine serving it may carry,
    ``(bf16_form, fp8_form)``. BF16 form: every tensor in ``runtime_dtype``, no scales (the engine
    quantizes). FP8 form: quantized weights float8_e4m3fn with their float32 ``_scale_inv``, the
    rest in ``runtime_dtype`` (the trainer quantized)."""
    float_dtypes = {"float64", "float32", "float16", "bfloat16"}
    fp8_form: dict[str, TensorSpec] = {}
    bf16_form: dict[str, TensorSpec] = {}
    for name, spec in fp8_specs.items():
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in fp8_specs:
            fp8_form[name] = spec.model_copy(update={"dtype": "float32"})
            continue
        if spec.dtype == "float8_e4m3fn":
            fp8_form[name] = spec
            bf16_form[name] = spec.model_copy(update={"dtype": runtime_dtype})
            continue
        same = spec.model_copy(update={"dtype": runtime_dtype}) if spec.dtype in float_dtypes else spec
        fp8_form[name] = bf16_form[name] = same
    return bf16_form, fp8_form


def is_fp8_form(names: Iterable[str]) -> bool:
    """Whether a push's tensor names are in FP8 form (it carries block scales)."""
    return any(n.endswith(SCALE_SUFFIX) for n in names)


class Fp8Forms:
    """What a push into an engine serving an FP8 block copy may carry, and the checks both forms
    share (every backend's receiver uses this one): the BF16 form (the engine quantizes) or the
    FP8 form (the trainer quantized, ``WeightSync.push(quantize="fp8_block")``), picked per push
    by its tensor names (:func:`is_fp8_form`). ``fp8_specs``: the FP8 checkpoint's specs as
    stored; ``runtime_dtype``: the engine's dtype for everything else."""

    def __init__(self, fp8_specs: Mapping[str, TensorSpec], runtime_dtype: str) -> None:
        self.bf16, self.fp8 = spec_forms(fp8_specs, runtime_dtype)
        #: Names of the weights the engine holds in FP8.
        self.quantized = frozenset(n.removesuffix(SCALE_SUFFIX) for n in self.fp8 if n.endswith(SCALE_SUFFIX))

    def specs_for(self, names: Iterable[str]) -> dict[str, TensorSpec]:
        """The form a push of tensors ``names`` is checked against."""
        return self.fp8 if is_fp8_form(names) else self.bf16

    def problems(self, names: Iterable[str]) -> list[str]:
        """What is wrong with a push of ``names`` before anything is applied: in the FP8 form a
        weight and its scales travel together (a weight without its scales, or scales without their
        weight, would leave the engine with mismatched halves)."""
        names = set(names)
        if not is_fp8_form(names):
            return []
        out = [f"'{n}' comes without '{n.removesuffix(SCALE_SUFFIX)}'" for n in sorted(names)
               if n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) not in names]
        out += [f"'{n}' comes without its scales '{n}{SCALE_SUFFIX}'" for n in sorted(names)
                if n in self.quantized and n + SCALE_SUFFIX not in names]
        return out

    @classmethod
    def of_checkpoint(cls, model_dir: str | Path, runtime_dtype: str) -> Fp8Forms | None:
        """The forms of the checkpoint in ``model_dir`` if it is an FP8 block checkpoint, else None."""
        if read_block_config(model_dir) is None:
            return None
        return cls(checkpoint_specs(model_dir), runtime_dtype)


def read_block_config(model_dir: str | Path) -> tuple[int, int] | None:
    """The weight block size of an FP8 block checkpoint (its ``config.json``), or None."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant or quant.get("quant_method") != "fp8" or not quant.get("weight_block_size"):
        return None
    bn, bk = quant["weight_block_size"]
    return int(bn), int(bk)


def fp8_block_checkpoint(
    src_dir: str | Path, dst_dir: str | Path, *, block: tuple[int, int] = BLOCK, device: str | torch.device = "cpu"
) -> Path:
    """Write the FP8 block copy of the HF safetensors checkpoint ``src_dir`` into ``dst_dir`` (which
    must not exist or be empty): the same shards with quantized weights and their scales, the
    index updated, ``config.json`` with ``quantization_config``, every other file copied (tokenizer,
    generation config). Quantizes on ``device`` (``"cuda"`` is much faster for large models).
    Written to a temporary sibling and renamed into place; returns ``dst_dir``."""
    from safetensors.torch import load_file, save_file

    src, final = Path(src_dir), Path(dst_dir).expanduser().resolve()
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}; an FP8 copy needs a safetensors checkpoint")
    with atomic_directory(final) as tmp:
        weight_map: dict[str, str] = {}
        total = 0
        for file in files:
            out: dict[str, torch.Tensor] = {}
            for name, tensor in load_file(str(file)).items():
                if is_fp8_quantized(name, tensor.shape) and tensor.is_floating_point():
                    q, s = quantize_fp8_block(tensor.to(device), block)
                    out[name], out[scale_name(name)] = q.cpu(), s.cpu()
                else:
                    out[name] = tensor
            for name, tensor in out.items():
                weight_map[name] = file.name
                total += tensor.numel() * tensor.element_size()
            save_file(out, str(tmp / file.name), metadata={"format": "pt"})
            del out
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = {**QUANTIZATION_CONFIG, "weight_block_size": list(block)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        index = src / "model.safetensors.index.json"
        if index.exists():
            data = json.loads(index.read_text())
            data["weight_map"] = weight_map
            data.setdefault("metadata", {})["total_size"] = total
            (tmp / index.name).write_text(json.dumps(data, indent=2) + "\n")
        for other in src.iterdir():
            if other.is_file() and not (tmp / other.name).exists() and other.suffix != ".safetensors":
                shutil.copyfile(other, tmp / other.name)
    return final


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "rollout-engines"


def fp8_block_checkpoint_cached(
    src_dir: str | Path, *, block: tuple[int, int] = BLOCK, device: str | torch.device = "cpu",
    root: str | Path | None = None,
) -> Path:
    """The FP8 block copy of ``src_dir``, built on first use into
    ``$ROLLOUT_ENGINES_CACHE/fp8-block/<name>-<key>`` (default root ``~/.cache/rollout-engines``).
    The key hashes the source's path and its files' names, sizes and modification times, the
    block and :data:`FORMAT_VERSION`: a changed checkpoint gets a new copy."""
    src = Path(src_dir).resolve()
    h = hashlib.sha256(f"{src}|{block}|{FORMAT_VERSION}".encode())
    for f in sorted(src.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    path = Path(root) if root is not None else cache_root() / "fp8-block"
    path = path / f"{src.name}-{h.hexdigest()[:12]}"
    if (path / "config.json").is_file():
        return path
    try:
        return fp8_block_checkpoint(src, path, block=block, device=device)
    except (FileExistsError, OSError):
        if (path / "config.json").is_file():  # another process built it first
            return path
        raise


def served_checkpoint(model_dir: str | Path, weight_quantization: str) -> str:
    """The checkpoint an engine loads for its option ``weight_quantization`` (every backend names
    it so): ``model_dir`` itself for ``"none"``, its cached FP8 block copy for ``"fp8_block"``
    (built on first use, :func:`fp8_block_checkpoint_cached`)."""
    if weight_quantization == "none":
        return str(model_dir)
    if weight_quantization != "fp8_block":
        raise ValueError(f"weight_quantization={weight_quantization!r}: use 'none' or 'fp8_block'")
    import logging
    import time

    start = time.perf_counter()
    path = fp8_block_checkpoint_cached(model_dir)
    logging.getLogger("rollout_engines.fp8").info(
        "serving the FP8 block copy %s of %s (%.1f s to find or build)", path, model_dir, time.perf_counter() - start
    )
    return str(path)


__all__ = [
    "BLOCK", "FP8_MAX", "Fp8Forms", "QUANTIZATION_CONFIG", "Quantization", "dequantize_fp8_block", "fp8_block_checkpoint",
    "fp8_block_checkpoint_cached", "is_fp8_form", "is_fp8_quantized", "quantize_fp8_block", "quantize_named",
    "quantized_specs", "read_block_config", "scale_name", "served_checkpoint", "scale_shape", "spec_forms",
]
