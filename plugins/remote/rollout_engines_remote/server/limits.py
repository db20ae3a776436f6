"""The server's default limits, and :class:`Limits`: request checks beyond the core's models."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rollout_engines.engine import Engine
from rollout_engines.types import GenerateRequest

from .errors import FieldError

logger = logging.getLogger("rollout_engines.remote.server")

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_BUCKET_BYTES = 8 * 2**30
DEFAULT_MAX_SEQUENCES = 4096
DEFAULT_MAX_CONCURRENCY = 512
DEFAULT_BODY_READ_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5
#: Largest ``top_k`` any backend can take (a 32-bit count), where the vocabulary size is unknown.
MAX_TOP_K = 2**31 - 1


class Limits:
    """What the server checks beyond the core's models, so that no request value can make the
    engine fail with a 5xx: sequences per request, the seed's range, finite floats, token ids and
    ``top_k`` within the vocabulary. Prompt lengths are the engine's to check (it raises
    ``InvalidRequest``)."""

    def __init__(self, engine: Engine, max_sequences: int = DEFAULT_MAX_SEQUENCES) -> None:
        self.vocab_size: int | None = None
        self.max_sequences = max_sequences
        self.tokenizer: Any = None
        cfg_file = Path(engine.config.model) / "config.json"
        if cfg_file.is_file():
            try:
                self.vocab_size = json.loads(cfg_file.read_text()).get("vocab_size")
            except (OSError, ValueError):
                logger.warning("could not read %s; token ids are not range-checked", cfg_file)
        path = Path(engine.config.tokenizer or engine.config.model)
        if path.is_dir():
            try:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(str(path))
            except Exception:  # a backend with its own tokenizer format: logprob tokens show as ids
                logger.info("no transformers tokenizer at %s; logprob tokens are shown as ids", path)

    def decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))

    def check(self, req: GenerateRequest) -> None:
        s = req.sampling
        if not math.isfinite(s.temperature):
            raise FieldError("sampling.temperature", "must be a finite number")
        if s.seed is not None and not -(2**63) <= s.seed < 2**63:
            raise FieldError("sampling.seed", "must fit in 64 bits: [-2**63, 2**63)")
        for i, conversation in enumerate(req.messages or []):
            if not conversation:
                raise FieldError(f"messages.{i}", "a conversation needs at least one message")
        top_k_limit = self.vocab_size or MAX_TOP_K
        if s.top_k > top_k_limit:
            what = f"the vocabulary size ({self.vocab_size})" if self.vocab_size else f"{MAX_TOP_K}"
            raise FieldError("sampling.top_k", f"top_k {s.top_k} is larger than {what}; use -1 to disable top-k")
        if req.batch_size * s.n > self.max_sequences:
            raise FieldError("sampling.n", f"batch size x n = {req.batch_size * s.n} exceeds this server's "
                             f"limit of {self.max_sequences} sequences per request; split the batch")
        if self.vocab_size:
            ids = [t for p in req.prompt_token_ids or [] for t in p]
            earlier = [t for c in req.continue_from or [] for t in (*c.prompt_token_ids, *c.token_ids)]
            for name, values in (("prompt_token_ids", ids), ("sampling.stop_token_ids", s.stop_token_ids),
                                 ("continue_from", earlier)):
                self.check_token_ids(name, values)

    def check_token_ids(self, name: str, values: Iterable[int], vocab_size: int | None = None) -> None:
        """Raise :class:`FieldError` naming ``name`` where a token id lies outside the vocabulary
        (``vocab_size``, else the model's; unknown: nothing is checked)."""
        size = vocab_size or self.vocab_size
        if not size:
            return
        bad = next((t for t in values if not 0 <= t < size), None)
        if bad is not None:
            raise FieldError(name, f"token id {bad} is outside the vocabulary (size {size}); token ids are 0 to "
                             f"{size - 1}")
