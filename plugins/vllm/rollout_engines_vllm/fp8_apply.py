"""Pushes into a vLLM engine serving an FP8 block copy of the model (option ``weight_quantization``).

What vLLM 0.26 holds after loading an FP8 block checkpoint (``Fp8LinearMethod`` with
``weight_block_size``) on CUDA with the CUTLASS or Triton block kernel: per linear layer ``weight``
float8_e4m3fn ``[out_per_partition, in_per_partition]`` (row-major, not transposed: the kernel takes
``B.T`` as a view at each call) and ``weight_scale_inv`` float32 ``[ceil(out/bn), ceil(in/bk)]``,
exactly the checkpoint layout, fused modules (``qkv_proj``, ``gate_up_proj``) stacking their
shards' rows (vLLM requires every shard but the last to fill whole blocks). Post-processing leaves
both as they are (``Fp8BlockScaledMMLinearKernel.process_weights_after_loading``: no transpose,
no requantization; padding is ROCm-only). But it re-registers them as plain ``Parameter``s, so
``model.load_weights`` no longer works after start-up (its loaders call methods of vLLM's
parameter classes); vLLM's answer is ``reload_weights`` (layerwise: rebuild each layer's loading
parameters, load, post-process, copy into the running storage).

So a push is applied one of two ways:

- **direct** (CUTLASS / Triton kernels, the layer types below): each weight is written into its
  rows of the running parameters, quantized on the way where it arrives in BF16 (a Triton kernel
  reading the received tensor once and writing FP8 and scales, or the pure-torch quantizer), or
  copied where the trainer already quantized. Storage never moves, so captured CUDA graphs stay valid;
- **reload** (any other kernel layout, e.g. DeepGEMM's, or a layer not recognised): the
  checkpoint-form tensors go through vLLM's ``reload_weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from rollout_engines.weights.fp8 import FP8_DTYPE, SCALE_SUFFIX, quantize_fp8_block, quantize_named

logger = logging.getLogger("rollout_engines.vllm.fp8")

#: Block kernels whose post-processing keeps the checkpoint layout (see the module docstring).
IDENTITY_KERNELS = {"CutlassFp8BlockScaledMMKernel", "TritonFp8BlockScaledMMKernel"}


@dataclass
class _Dest:
    """Where one checkpoint weight lands in this worker: rows ``[row, row + rows)`` of ``weight``
    (and the matching block rows of ``scale``), from rows ``src_row..`` and columns
    ``src_col..src_col + cols`` of the full checkpoint tensor."""

    weight: torch.Tensor
    scale: torch.Tensor
    row: int
    rows: int
    src_row: int
    src_col: int
    cols: int


class Fp8BlockApplier:
    """Writes checkpoint-form weights (BF16, or FP8 with scales) into a running FP8 block model."""

    def __init__(self, worker: Any, block: tuple[int, int], *, always_reload: bool = False) -> None:
        self.worker, self.block = worker, block
        self.always_reload = always_reload  # the engine option fp8_apply="reload"
        model = worker.model_runner.get_model()
        self.packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        self.modules = dict(model.named_modules())
        self.device = torch.device(getattr(worker, "device", "cpu"))
        self._dests: dict[str, _Dest | None] = {}
        self._pending: dict[str, torch.Tensor] = {}  # half of an FP8 pair, waiting for the other half
        self.use_triton = self.device.type == "cuda" and _triton_quantizer() is not None
        self.reload_sizes: list[int] = []  #: per load through vLLM's reload_weights: its quantized weights

    # ---- planning ----------------------------------------------------------------------------------
    def dest(self, name: str) -> _Dest | None:
        if self.always_reload:
            return None
        if name not in self._dests:
            self._dests[name] = self._plan(name)
        return self._dests[name]

    def _plan(self, name: str) -> _Dest | None:
        from vllm.model_executor.layers.linear import (
            ColumnParallelLinear,
            MergedColumnParallelLinear,
            QKVParallelLinear,
            ReplicatedLinear,
            RowParallelLinear,
        )

        module_name, _, param = name.rpartition(".")
        if param != "weight":
            return None
        parent, _, leaf = module_name.rpartition(".")
        shard = None
        for packed, subs in self.packed.items():
            if leaf in subs:
                module_name, shard = f"{parent}.{packed}" if parent else packed, subs.index(leaf)
                break
        layer = self.modules.get(module_name)
        method = getattr(layer, "quant_method", None)
        kernel = getattr(method, "fp8_linear", None)
        if layer is None or type(method).__name__ != "Fp8LinearMethod" or type(kernel).__name__ not in IDENTITY_KERNELS:
            return None
        weight, scale = getattr(layer, "weight", None), getattr(layer, "weight_scale_inv", None)
        bn, bk = self.block
        if (
            weight is None or scale is None or weight.dtype != FP8_DTYPE or scale.dtype != torch.float32
            or weight.dim() != 2 or not weight.is_contiguous() or not scale.is_contiguous()
            or tuple(scale.shape) != (-(-weight.shape[0] // bn), -(-weight.shape[1] // bk))
        ):
            return None
        out_pp, in_pp = weight.shape
        rank, tp = int(getattr(layer, "tp_rank", 0)), int(getattr(layer, "tp_size", 1))
        src_col, cols = 0, in_pp
        if isinstance(layer, QKVParallelLinear):
            if shard is None:
                return None
            q, kv, v = layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size, (
                layer.num_kv_heads * layer.v_head_size)
            kv_rank = rank // layer.num_kv_head_replicas
            row, rows, src_row = [(0, q, rank * q), (q, kv, kv_rank * kv), (q + kv, v, kv_rank * v)][shard]
        elif isinstance(layer, MergedColumnParallelLinear):
            if shard is None:
                return None
            widths = [size // tp for size in layer.output_sizes]
            row, rows, src_row = sum(widths[:shard]), widths[shard], rank * widths[shard]
        elif isinstance(layer, ColumnParallelLinear) and shard is None:
            row, rows, src_row = 0, out_pp, rank * out_pp
        elif isinstance(layer, RowParallelLinear) and shard is None:
            row, rows, src_row, src_col = 0, out_pp, 0, rank * in_pp if tp > 1 else 0
        elif isinstance(layer, ReplicatedLinear) and shard is None:
            row, rows, src_row = 0, out_pp, 0
        else:
            return None
        if row % bn or src_row % bn or src_col % bk or row + rows > out_pp:
            return None  # not on block boundaries: vLLM's reload handles it
        return _Dest(weight.data, scale.data, row, rows, src_row, src_col, cols)

    # ---- applying ------------------------------------------------------------------------------------
    def direct(self, names: Iterable[str]) -> bool:
        """Whether every weight of ``names`` has a direct destination (else pushes take the reload
        path, which needs whole layers: staged updates only)."""
        return all(self.dest(n) is not None for n in names)

    def apply(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load quantized-layer tensors: ``x.weight`` in BF16 (quantized here), or ``x.weight`` in FP8
        with ``x.weight_scale_inv``. Everything is planned before anything is written. An FP8 weight
        and its scales split over two buckets (``inplace`` updates) meet here: the first to arrive
        is kept (copied: the bucket is reused) until the other comes."""
        scales = {n.removesuffix(SCALE_SUFFIX): t for n, t in named if n.endswith(SCALE_SUFFIX)}
        pairs: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
        for name, tensor in named:
            if name.endswith(SCALE_SUFFIX):
                continue
            if tensor.dtype != FP8_DTYPE:
                pairs.append((name, tensor, None))
                continue
            scale = scales.pop(name, None)
            if scale is None:
                scale = self._pending.pop(name + SCALE_SUFFIX, None)
            if scale is None:
                self._pending[name] = tensor.clone()
            else:
                pairs.append((name, tensor, scale))
        for name, scale in scales.items():  # scales whose weight came in an earlier bucket, or comes later
            weight = self._pending.pop(name, None)
            if weight is None:
                self._pending[name + SCALE_SUFFIX] = scale.clone()
            else:
                pairs.append((name, weight, scale))
        dests = [self.dest(n) for n, _, _ in pairs]
        if any(d is None for d in dests):
            missing = [n for (n, _, _), d in zip(pairs, dests, strict=True) if d is None]
            logger.info("FP8 push through vLLM's reload_weights (no direct layout for %s)", missing[:3])
            self._reload(pairs)
            return
        bn, bk = self.block
        with torch.no_grad():
            for (_, tensor, scale), d in zip(pairs, dests, strict=True):
                assert d is not None
                src = tensor[d.src_row:d.src_row + d.rows, d.src_col:d.src_col + d.cols]
                w_dst = d.weight[d.row:d.row + d.rows]
                s_dst = d.scale[d.row // bn:d.row // bn + -(-d.rows // bn)]
                if scale is not None:
                    w_dst.copy_(src, non_blocking=True)
                    s_dst.copy_(scale[d.src_row // bn:, d.src_col // bk:][: s_dst.shape[0], : s_dst.shape[1]],
                                non_blocking=True)
                    continue
                src = src.to(self.device, non_blocking=True)
                if self.use_triton:
                    _triton_quantizer()(src, w_dst, s_dst, self.block)
                else:
                    q, s = quantize_fp8_block(src, self.block)
                    w_dst.copy_(q)
                    s_dst.copy_(s)

    def _reload(self, pairs: list[tuple[str, torch.Tensor, torch.Tensor | None]]) -> None:
        self.reload_sizes.append(len(pairs))

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor, scale in pairs:
                if scale is None:  # BF16: quantized on this worker's device, one tensor at a time
                    yield from quantize_named([(name, tensor.to(self.device))], self.block)
                else:
                    yield name, tensor
                    yield name + SCALE_SUFFIX, scale

        self.worker.reload_weights(weights_iterator=stream(), is_checkpoint_format=True)


_TRITON: Any = None


def _triton_quantizer() -> Any:
    """``quantize(src, q_out, s_out, block)``: one Triton program per block reads ``src`` (any float,
    strided) once and writes FP8 and the block's scale straight into the destination views;
    the same arithmetic as :func:`rollout_engines.weights.fp8.quantize_fp8_block`. None without Triton."""
    global _TRITON
    if _TRITON is not None:
        return _TRITON or None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _TRITON = False
        return None
    from rollout_engines.weights.fp8 import AMAX_FLOOR, FP8_MAX

    @triton.jit
    def kernel(x, q, s, n, k, sxn, sxk, sqn, sqk, ssn, ssk,
               BN: tl.constexpr, BK: tl.constexpr, FMAX: tl.constexpr, FLOOR: tl.constexpr):
        i, j = tl.program_id(0), tl.program_id(1)
        rn = i * BN + tl.arange(0, BN)
        rk = j * BK + tl.arange(0, BK)
        mask = (rn[:, None] < n) & (rk[None, :] < k)
        v = tl.load(x + rn[:, None] * sxn + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(v), axis=1), axis=0), FLOOR)
        # IEEE division, as torch does (Triton's '/' is approximate on fp32).
        scale = tl.math.div_rn(amax, tl.full([], FMAX, tl.float32))
        y = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FMAX), FMAX)
        tl.store(q + rn[:, None] * sqn + rk[None, :] * sqk, y.to(q.dtype.element_ty), mask=mask)
        tl.store(s + i * ssn + j * ssk, scale)

    def quantize(src: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, block: tuple[int, int]) -> None:
        n, k = src.shape
        bn, bk = block
        grid = (-(-n // bn), -(-k // bk))
        kernel[grid](src, q_out, s_out, n, k, src.stride(0), src.stride(1), q_out.stride(0), q_out.stride(1),
                     s_out.stride(0), s_out.stride(1), BN=bn, BK=bk, FMAX=FP8_MAX, FLOOR=AMAX_FLOOR, num_warps=8)

    _TRITON = quantize
    return quantize
