"""The tiny test model: deterministic, loadable by transformers, safe to build concurrently."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rollout_engines.testing import tiny_model as tm

pytestmark = pytest.mark.transformers


def _fingerprint(path: Path) -> str:
    return tm._fingerprint(path)


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model: Path, tmp_path: Path) -> None:
    again = tm.build_tiny_model(tmp_path / "seed0", seed=0)
    assert _fingerprint(again) == _fingerprint(tiny_model)

    from safetensors.torch import load_file

    other = tm.build_tiny_model(tmp_path / "seed1", seed=1)
    a, b = load_file(str(tiny_model / "model.safetensors")), load_file(str(other / "model.safetensors"))
    assert a.keys() == b.keys()
    assert not all((a[k] == b[k]).all() for k in a if a[k].is_floating_point() and a[k].dim() == 2)
    # The tokenizer is trained on seeded text too: another seed gives another vocabulary.
    assert (tiny_model / "tokenizer.json").read_bytes() != (other / "tokenizer.json").read_bytes()


def test_loads_in_transformers_with_the_promised_shape(tiny_model: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model)
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (128, 2, 4, 2)
    assert config.vocab_size == 4096 and config.tie_word_embeddings and config.max_position_embeddings == 2048
    model, info = AutoModelForCausalLM.from_pretrained(tiny_model, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in tm.qwen2_tensor_shapes()]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # Stored as float32 safetensors, tied weights once.
    from safetensors import safe_open

    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert {str(f.get_tensor(n).dtype) for n in names} == {"torch.float32"}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_tokenizer_specials_and_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok) == 4096
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert sorted(ids.values()) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "def add(a, b):\n    return a + b  # 123 héllo"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: lossless, even off-corpus
    # Qwen2's pre-tokenizer (digits one by one), which transformers 5 imposes on qwen2 models.
    assert len(tok("12345")["input_ids"]) == 5
    assert tok.convert_ids_to_tokens(list(range(4096))).count(None) == 0
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    if hasattr(chat_ids, "keys"):  # transformers 5 returns a BatchEncoding
        chat_ids = chat_ids["input_ids"]
    assert list(chat_ids)[0] == ids["<|im_start|>"]
    gen = GenerationConfig.from_pretrained(tiny_model)
    assert set(gen.eos_token_id) == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    assert json.loads((tiny_model / "tiny_model.json").read_text())["version"] == tm.TINY_MODEL_VERSION


def test_incomplete_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not a complete tiny model"):
        tm.build_tiny_model(tmp_path / "half")


def test_cache_location_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tm.CACHE_ENV, str(tmp_path))
    name = f"tiny-qwen2-{tm.TINY_MODEL_VERSION}-{tm._recipe_hash()}"
    assert tm.default_cache_dir() == tmp_path / name
    monkeypatch.delenv(tm.CACHE_ENV)
    assert tm.default_cache_dir() == Path.home() / ".cache" / "rollout-engines" / name


def test_concurrent_builders_leave_one_complete_copy(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unlocked builders race for the final rename: both must get the same complete model.
    target = tmp_path / "race"
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: tm.build_tiny_model(target), range(2)))
    assert paths == [target.resolve()] * 2
    assert _fingerprint(target) == _fingerprint(tiny_model)
    assert [p.name for p in tmp_path.iterdir()] == ["race"], "temporary folders were left behind"
    # tiny_model_path() takes a file lock: concurrent callers wait for one build.
    monkeypatch.setenv(tm.CACHE_ENV, str(tmp_path / "cache"))
    with ThreadPoolExecutor(2) as pool:
        cached = set(pool.map(lambda _: tm.tiny_model_path(), range(2)))
    assert cached == {tm.default_cache_dir()}
    assert _fingerprint(cached.pop()) == _fingerprint(tiny_model)
