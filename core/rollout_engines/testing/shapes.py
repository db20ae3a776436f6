"""Random-init checkpoints of real model shapes, for benchmarks (weight pushes, refit, generate).

:func:`build_shape` writes a Qwen3-architecture checkpoint (Qwen2 where the installed transformers
has no Qwen3) of a named shape: sharded safetensors (~4 GB a shard) with
``model.safetensors.index.json``, ``config.json``, ``generation_config.json`` and a local tokenizer.
Tensors are generated one at a time with a seeded generator on ``device`` (``"cuda"`` is much
faster for the large shapes) and written shard by shard, so at most one shard is ever in memory.

The tokenizer is the tiny test model's (4,096 tokens, :mod:`.tiny_model`), while ``config.json``
keeps the shape's real ``vocab_size`` (151,936) unless ``vocab_size=`` says otherwise: the
embedding and LM-head sizes, hence the bytes a push moves, are the real ones. A tokenizer smaller
than the model's vocabulary is normal (real Qwen checkpoints have 151,669 tokens for 151,936 rows)
and both transformers and vLLM generate from token ids with it; a random model will mostly emit ids
above 4,095, which decode to nothing, so benchmarks should read ``token_ids``, not ``text``.
Pass ``vocab_size=4096`` when decodable text matters more than the real size.

    python -m rollout_engines.testing.shapes qwen3-14b /models/qwen3-14b-random --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

#: Bytes a shard may reach before the next one starts.
SHARD_BYTES = 4 * 10**9
INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tie_word_embeddings: bool
    vocab_size: int = 151936
    max_positions: int = 40960
    rope_theta: float = 1_000_000.0
    init_std: float = 0.02
    #: Mixture of experts (Qwen3-MoE): routed experts per layer (0: a dense MLP), experts each
    #: token goes to, and each expert's MLP width.
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0


#: The named shapes (Qwen3 model cards / config.json of Qwen/Qwen3-0.6B, -8B, -14B, -30B-A3B).
SHAPES: dict[str, Shape] = {
    "tiny": Shape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=256,
                  tie_word_embeddings=True, vocab_size=4096, max_positions=2048, init_std=0.1),
    "tiny-moe": Shape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=256,
                      tie_word_embeddings=False, vocab_size=4096, max_positions=2048, init_std=0.1,
                      experts=8, experts_per_token=2, moe_intermediate=64),
    "qwen3-0.6b": Shape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                        tie_word_embeddings=True),
    "qwen3-8b": Shape(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                      tie_word_embeddings=False),
    "qwen3-14b": Shape(hidden=5120, layers=40, heads=40, kv_heads=8, head_dim=128, intermediate=17408,
                       tie_word_embeddings=False),
    # 30.5 B parameters (61 GB in bf16), 3.3 B active; 18,900 tensors (128 experts x 3 per layer).
    "qwen3-30b-a3b": Shape(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=6144,
                           tie_word_embeddings=False, experts=128, experts_per_token=8, moe_intermediate=768),
}


def _qwen3_available() -> bool:
    try:
        from transformers import Qwen3Config  # noqa: F401
    except ImportError:
        return False
    return True


def tensor_shapes(shape: Shape, *, qwen3: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """Every stored tensor, in parameter order (HF names). Qwen2 has q/k/v biases and no q/k norms;
    its head dim is ``hidden // heads``. A mixture-of-experts shape stores each layer's router
    (``mlp.gate``) and every expert's projections (``mlp.experts.<e>.gate_proj`` ...), as Qwen3-MoE
    checkpoints do (transformers fuses them on load, vLLM and SGLang read them by these names)."""
    h, inter = shape.hidden, shape.intermediate
    hd = shape.head_dim if qwen3 else h // shape.heads
    q, kv = shape.heads * hd, shape.kv_heads * hd
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab_size, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, h))]
        out += [] if qwen3 else [(p + "self_attn.q_proj.bias", (q,))]
        out += [(p + "self_attn.k_proj.weight", (kv, h))]
        out += [] if qwen3 else [(p + "self_attn.k_proj.bias", (kv,))]
        out += [(p + "self_attn.v_proj.weight", (kv, h))]
        out += [] if qwen3 else [(p + "self_attn.v_proj.bias", (kv,))]
        out += [(p + "self_attn.o_proj.weight", (h, q))]
        if qwen3:
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        if shape.experts:
            e_inter = shape.moe_intermediate
            out += [(p + "mlp.gate.weight", (shape.experts, h))]
            for e in range(shape.experts):
                out += [
                    (p + f"mlp.experts.{e}.gate_proj.weight", (e_inter, h)),
                    (p + f"mlp.experts.{e}.up_proj.weight", (e_inter, h)),
                    (p + f"mlp.experts.{e}.down_proj.weight", (h, e_inter)),
                ]
        else:
            out += [
                (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
            ]
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not shape.tie_word_embeddings:
        out.append(("lm_head.weight", (shape.vocab_size, h)))
    return out


def _config(shape: Shape, qwen3: bool, dtype: str, special_ids: dict[str, int]) -> dict[str, Any]:
    eos, pad = special_ids["<|im_end|>"], special_ids["<|endoftext|>"]
    config: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM"],
        "model_type": "qwen3" if qwen3 else "qwen2",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_positions,
        "max_window_layers": shape.layers,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "initializer_range": shape.init_std,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": dtype,
    }
    if qwen3:
        config.update(head_dim=shape.head_dim, attention_bias=False)
    if shape.experts:
        config.update(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=shape.experts,
            num_experts_per_tok=shape.experts_per_token, moe_intermediate_size=shape.moe_intermediate,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    return config


def _plan_shards(tensors: list[tuple[str, tuple[int, ...]]], itemsize: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors:
        nbytes = itemsize
        for d in dims:
            nbytes *= d
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    return shards


def build_shape(
    name: str,
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    vocab_size: int | None = None,
    layers: int | None = None,
) -> Path:
    """Write the random-init checkpoint of shape ``name`` (a key of :data:`SHAPES`) into ``out_dir``.

    ``out_dir`` must not exist (or be an empty folder); files are written to a temporary sibling and
    renamed into place. ``layers`` overrides the layer count (small test builds of a real width).
    Returns the folder.
    """
    import torch
    from safetensors.torch import save_file

    from ..weights.buckets import torch_dtype
    from ..weights.checkpoint import atomic_directory
    from .tiny_model import tiny_model_path

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    shape = SHAPES[name]
    if vocab_size is not None:
        shape = replace(shape, vocab_size=vocab_size)
    if layers is not None:
        shape = replace(shape, layers=layers)
    tiny = tiny_model_path()
    special_ids: dict[str, int] = json.loads((tiny / "tiny_model.json").read_text())["special_token_ids"]
    if max(special_ids.values()) >= shape.vocab_size:
        raise ValueError(f"vocab_size {shape.vocab_size} is smaller than the tokenizer's special token ids")
    qwen3 = _qwen3_available()
    if shape.experts and not qwen3:
        raise ValueError(f"shape {name!r} is a Qwen3-MoE model; it needs transformers with Qwen3 (pip install -U transformers)")
    torch_type = torch_dtype(dtype)
    final = Path(out_dir).expanduser().resolve()
    with atomic_directory(final) as tmp:
        for f in _TOKENIZER_FILES:
            shutil.copyfile(tiny / f, tmp / f)
        (tmp / "config.json").write_text(json.dumps(_config(shape, qwen3, dtype, special_ids), indent=2) + "\n")
        eos, pad = special_ids["<|im_end|>"], special_ids["<|endoftext|>"]
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad}, indent=2) + "\n")
        shards = _plan_shards(tensor_shapes(shape, qwen3=qwen3), torch.empty((), dtype=torch_type).element_size())
        weight_map: dict[str, str] = {}
        total = 0
        index = 0
        for n, shard in enumerate(shards, 1):
            file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}
            for tensor_name, dims in shard:
                gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
                index += 1
                t = torch.empty(dims, dtype=torch_type, device=device).normal_(0.0, shape.init_std, generator=gen)
                if tensor_name.endswith("norm.weight"):
                    t += 1.0
                tensors[tensor_name] = t.cpu()
                weight_map[tensor_name] = file
                total += t.numel() * t.element_size()
                del t
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            del tensors
        (tmp / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        for written in tmp.iterdir():
            written.chmod(0o644)
        tmp.chmod(0o755)
    return final


__all__ = ["SHAPES", "Shape", "build_shape", "tensor_shapes"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_engines.testing.shapes", description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("out")
    parser.add_argument("--device", default="cpu", help="where tensors are generated ('cuda' is faster)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the shape's real vocabulary")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    args = parser.parse_args(argv)
    path = build_shape(args.name, args.out, dtype=args.dtype, device=args.device, seed=args.seed,
                       vocab_size=args.vocab_size, layers=args.layers)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

