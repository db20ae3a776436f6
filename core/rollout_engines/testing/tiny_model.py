"""A tiny, deterministic Qwen2-architecture model built locally, with no network.

Tests and demos of every backend need a real model that loads in ``transformers`` *and* in the
engines (vLLM, SGLang), yet is small enough to run on a laptop CPU in milliseconds. This module
builds one from nothing:

- random weights of a 2-layer :class:`~transformers.Qwen2ForCausalLM` (hidden 128, 4 heads, 2 KV
  heads, vocab 4096, tied embeddings), saved as float32 safetensors;
- a byte-level BPE tokenizer (Qwen2's pre-tokenizer) trained with ``tokenizers`` on text
  generated here from a seeded random generator (so the result does not depend on the Python
  version or the files on disk), in the ``PreTrainedTokenizerFast`` layout with a ChatML chat
  template;
- ``generation_config.json`` naming the end-of-sequence tokens.

The same seed gives byte-identical files under transformers 4 and 5 (the JSON files are written
here, not by ``save_pretrained``). :func:`tiny_model_path` builds the model once into a cache
folder and returns it; concurrent processes are safe (file lock plus an atomic rename).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("rollout_engines.testing.tiny_model")

#: Names the model's shape; the cache folder adds a hash of this file, so an edited recipe rebuilds.
TINY_MODEL_VERSION = "v4"
CACHE_ENV = "ROLLOUT_ENGINES_CACHE"

VOCAB_SIZE = 4096
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, MAX_POSITIONS = 128, 256, 2, 4, 2, 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Larger than transformers' default (0.02) so that logits are spread out: greedy decoding then has
# clear winners, which keeps cross-engine token agreement robust to float rounding differences.
INITIALIZER_RANGE = 0.1
#: Files every complete build contains (the cache is trusted only when all are present).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "tiny_model.json",
)

_WORDS = """
the of and to in is was for on that with as by at from his her he she it they we you this be are
not or have has had were but one all can would there their which been if more when will who what
about up out them some so into time two may first then do any like my now over such our man me
even most made after also did many before must through back years where much your way well down
should because each just those people how too little state good very make world still own see men
work long get here between both life being under never day same another know while last might us
great old year off come since against go came right used take three model engine weight token
trainer reward policy sample batch prompt answer question reason number value state action learn
update version push sleep wake cache memory tensor buffer bucket layer head vector matrix gradient
loss step run test check error message name file path data text code line word letter house water
river mountain city road tree flower bird fish cloud rain snow sun moon star light dark fire stone
green blue red yellow black white small large quick slow happy calm bright quiet gentle brave
""".split()

_SYLLABLES = (
    "ka ri to na mi se lo pu ve da ze ko ra ni ta mo shi lu fe gi an en in on un ar er or al el il "
    "ba be bi bo bu ca ce ci co cu tha the thi str pla pre tri qua que"
).split()

_CODE_LINES = (
    "def {w}({v}):",
    "    return {v} + {n}",
    "    if {v} is None:",
    "        raise ValueError('{w} must be set')",
    "for {v} in range({n}):",
    "    {w}.append({v} * {n})",
    "class {W}:",
    '    """{W} keeps the {w} of a {v}."""',
    "import {w}",
    "{v} = {{'{w}': {n}, '{v}': [{n}, {n}]}}",
    "print(f'{w}={{{v}}}')",
)


def _corpus(seed: int, sentences: int = 10000) -> Iterator[str]:
    """Text in English-like words, pseudo-words, numbers, code and chat turns; seeded."""
    rng = random.Random(seed)

    def pseudo() -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))

    def word() -> str:
        return rng.choice(_WORDS) if rng.random() < 0.8 else pseudo()

    for i in range(sentences):
        kind = i % 5
        if kind in (0, 1):
            words = [word() for _ in range(rng.randint(5, 16))]
            words[0] = words[0].capitalize()
            yield " ".join(words) + rng.choice([".", ".", "?", "!", ","]) + "\n"
        elif kind == 2:
            w, v = pseudo(), rng.choice(_WORDS)
            line = rng.choice(_CODE_LINES)
            yield line.format(w=w, v=v, W=w.capitalize(), n=rng.randint(0, 999)) + "\n"
        elif kind == 3:
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            yield f"{a} + {b} = {a + b}; {a} * {b % 100} = {a * (b % 100)}\n"
        else:
            user = " ".join(word() for _ in range(rng.randint(3, 9)))
            reply = " ".join(word() for _ in range(rng.randint(3, 12)))
            yield (
                f"<|im_start|>user\n{user}?<|im_end|>\n<|im_start|>assistant\n{reply}.<|im_end|>\n"
                "<|endoftext|>"
            )


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _build_tokenizer(seed: int, out: Path) -> dict[str, int]:
    """Train the byte-level BPE tokenizer; write it in transformers' fast-tokenizer layout."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # Exactly Qwen2's pipeline: transformers 5 rebuilds a qwen2 model's tokenizer from the vocabulary
    # and merges with this normalizer and pre-tokenizer, so any other choice would tokenize
    # differently there than in transformers 4 (digits, for one).
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:  # every id the model can emit must decode
        raise RuntimeError(f"tokenizer training gave {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    tok.save(str(out / "tokenizer.json"))
    ids: dict[str, int] = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}  # type: ignore[misc]  # trained in: never None
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    })
    _write_json(out / "special_tokens_map.json", {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    })
    return ids


def qwen2_tensor_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the tiny model's checkpoint, in Qwen2ForCausalLM parameter order (HF names;
    ``lm_head.weight`` is tied to the embeddings and not stored)."""
    h, inter, heads, kv_heads = HIDDEN, INTERMEDIATE, HEADS, KV_HEADS
    head_dim = h // heads
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB_SIZE, h))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (heads * head_dim, h)),
            (p + "self_attn.q_proj.bias", (heads * head_dim,)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, h)),
            (p + "self_attn.k_proj.bias", (kv_heads * head_dim,)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, h)),
            (p + "self_attn.v_proj.bias", (kv_heads * head_dim,)),
            (p + "self_attn.o_proj.weight", (h, heads * head_dim)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    return shapes


def _build_weights(seed: int, out: Path, special_ids: dict[str, int]) -> None:
    """Write config, generation config and random float32 weights.

    Files are written directly (not through ``save_pretrained``), so their bytes do not depend on
    the installed transformers release and one cache serves environments with different releases.
    The weights come from a private generator: biases and norm scales are random too (not 0 and
    1), so an engine's weight loader that drops them is caught by the tests.
    """
    import torch
    from safetensors.torch import save_file

    eos, pad = special_ids["<|im_end|>"], special_ids["<|endoftext|>"]
    _write_json(out / "config.json", {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": LAYERS,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "initializer_range": INITIALIZER_RANGE,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    })
    _write_json(out / "generation_config.json", {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad})
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in qwen2_tensor_shapes():
        t = torch.empty(shape, dtype=torch.float32).normal_(0.0, INITIALIZER_RANGE, generator=gen)
        tensors[name] = t + 1.0 if name.endswith("norm.weight") else t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    for name in sorted(p.name for p in path.iterdir() if p.is_file()):
        digest.update(name.encode())
        digest.update((path / name).read_bytes())
    return digest.hexdigest()


def _is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in MODEL_FILES)


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so parallel builders wait instead of all building.

    Correctness does not depend on it (the final rename is atomic); it only saves work. Where
    ``fcntl`` is missing (Windows) the lock is skipped.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def build_tiny_model(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Build the tiny model into ``path`` (a folder that must not exist yet, or is already complete).

    Files are written into a temporary sibling folder which is then renamed into place, so a
    reader never sees a half-written model. If another process finished first, its copy is kept.
    Returns ``path``.
    """
    final = Path(path).expanduser().resolve()
    if _is_complete(final):
        return final
    if final.exists():
        raise FileExistsError(
            f"{final} exists but is not a complete tiny model (missing one of {list(MODEL_FILES)}); "
            "remove it and build again"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        special_ids = _build_tokenizer(seed, tmp)
        _build_weights(seed, tmp, special_ids)
        meta = {"version": TINY_MODEL_VERSION, "seed": seed, "special_token_ids": special_ids}
        (tmp / "tiny_model.json").write_text(json.dumps(meta, indent=2) + "\n")
        # mkdtemp makes a private folder; a shared cache must be readable by other processes/users.
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else renamed a complete build into place first: use theirs.
            if not _is_complete(final):
                raise
            logger.debug("tiny model at %s was built concurrently; keeping that copy", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny model at %s", final)
    return final


def _recipe_hash() -> str:
    """Short hash of this module's source: a changed recipe never reuses a cache built by the old one."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "rollout-engines"
    return base / f"tiny-qwen2-{TINY_MODEL_VERSION}-{_recipe_hash()}"


def tiny_model_path() -> Path:
    """The cached tiny model (seed 0), built on first use.

    The cache folder is ``$ROLLOUT_ENGINES_CACHE/tiny-qwen2-<version>-<recipe hash>`` or, without
    that variable, ``~/.cache/rollout-engines/tiny-qwen2-<version>-<recipe hash>``.
    """
    path = default_cache_dir()
    if _is_complete(path):
        return path
    with _file_lock(path.parent / f".{path.name}.lock"):
        return build_tiny_model(path, seed=0)


__all__ = [
    "TINY_MODEL_VERSION", "VOCAB_SIZE", "build_tiny_model", "default_cache_dir", "qwen2_tensor_shapes", "tiny_model_path",
]
