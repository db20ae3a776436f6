"""Tokenizer helpers shared by backends and tests (the same across transformers 4 and 5)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def chat_token_ids(tokenizer: Any, messages: Sequence[Any]) -> list[int]:
    """Token ids of a chat rendered with the model's template and a generation prompt.

    ``messages`` are dicts or pydantic ``ChatMessage``s. transformers 5 returns a BatchEncoding
    where 4 returned a list; both come back as a plain list."""
    chat = [m.model_dump() if hasattr(m, "model_dump") else dict(m) for m in messages]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
