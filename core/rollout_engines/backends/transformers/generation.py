"""The decode loop of the embedded engine: one left-padded batch, a KV cache, our own sampler.

A batch is a list of :class:`Row` (one per prompt and sample); rows of several requests may share
a batch, each with its own sampling parameters. Each distinct prompt is prefilled once; its ``n``
samples then share that prefill through the cache. Rows that finish are dropped from the cache,
so the remaining rows do not pay for them.

Stop semantics follow vLLM's defaults, so the backends agree token for token:

- a stop token (EOS unless ``ignore_eos``, or one of ``stop_token_ids``) ends the row with
  ``finish_reason="stop"``; the token is kept in ``token_ids`` and left out of ``text``;
- a stop string ends the row as soon as it appears in the decoded text: ``token_ids`` run through
  the token that completed it, ``text`` is cut just before it;
- reaching ``max_tokens`` (or the end of the context window) gives ``finish_reason="length"``.

``text`` is the decoded output with special tokens skipped.

Stop strings are found incrementally (:class:`StopStrings`): each step decodes only the few
tokens around the newest one and searches only the text a new match could touch (the new text and
the last ``len(longest stop) - 1`` characters before it), so the work per step does not grow with
the output.

A row whose request was cancelled (its ``cancel`` event set) is dropped at the next step with
``finish_reason="abort"``; a failure that belongs to one row (decoding its text, say) is kept on the
row (``error``) and ends only that row. The other rows of the batch carry on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ...types import Completion, FinishReason, SamplingParams
from .sampling import RowParams, RowSampling, row_generator, sample, sampling_state

# Tokens held back while they decode to an incomplete character (UTF-8 needs at most 4 bytes);
# past this many the text is taken as it decodes, so the window decoded per step stays bounded.
_MAX_PENDING_TOKENS = 8


class StopStrings:
    """The first stop string in a row's decoded text, found as the text grows.

    Incremental detokenization as vLLM does it: the text of the tokens since the last emitted
    ones, relative to the text of those last ones, so that a token's leading space or a character
    split over several byte tokens comes out right. Only ``tail`` (the last ``len(longest) - 1``
    characters already searched) plus the new text is searched each step."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self.keep = max(len(s) for s in self.stops) - 1
        self.prefix_offset = 0
        self.read_offset = 0
        self.seen = 0  # characters of text searched so far
        self.tail = ""

    def step(self, tokens: list[int], tokenizer: Any) -> int | None:
        """Take the newest token; return where the first stop string starts, if one now appears."""
        prefix = tokenizer.decode(tokens[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        text = tokenizer.decode(tokens[self.prefix_offset:], skip_special_tokens=True)
        pending = len(tokens) - self.read_offset
        complete = len(text) > len(prefix) and not text.endswith("\ufffd")
        if not complete and pending < _MAX_PENDING_TOKENS:
            return None
        new = text[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        if not new:
            return None
        window = self.tail + new
        start = self.seen - len(self.tail)
        self.seen += len(new)
        self.tail = window[max(0, len(window) - self.keep):] if self.keep else ""
        hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        return start + min(hits) if hits else None


@dataclass
class Row:
    """One sequence being generated (a prompt's ``sample_index``-th sample)."""

    prompt_key: int  # rows with the same key share a prompt (and its prefill)
    prompt_index: int
    sample_index: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    max_tokens: int  # already capped by the context window
    sampling: RowSampling | None = None  # checked per request; None: built from params in the batch
    generator: torch.Generator | None = None
    cancel: threading.Event | None = None  # set: the request was cancelled, drop the row
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    stopped_by_token: bool = False
    cut: int | None = None  # where a stop string starts in the decoded text
    stop_strings: StopStrings | None = None
    error: BaseException | None = None  # a failure of this row alone

    def completion(self, tokenizer: Any, version: int) -> Completion:
        kept = self.tokens[:-1] if self.stopped_by_token else self.tokens
        text = tokenizer.decode(kept, skip_special_tokens=True)
        if self.cut is not None:
            # Once per row: where the whole text has the stop string (the incremental text agrees
            # but for how an incomplete character was rendered).
            hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
            text = text[: min(hits) if hits else self.cut]
        return Completion(
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            prompt_token_ids=list(self.prompt),
            token_ids=list(self.tokens),
            text=text,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            finish_reason=self.finish or "length",
            weight_version=version,
        )


def make_rows(
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    eos_ids: frozenset[int],
    max_len: int,
    device: torch.device,
    first_key: int = 0,
    vocab: int | None = None,
    cancel: threading.Event | None = None,
) -> list[Row]:
    """Rows of one request, prompt-major (all samples of prompt 0 first).

    Everything that depends on the request's values alone is built here, so a request whose values
    cannot be used fails here rather than in the batch it would have joined. ``vocab``: check and
    clamp the sampling values for it now (else the batch does, for all its rows)."""
    stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
    sampling = sampling_state(params, vocab) if vocab is not None else None
    rows = []
    for i, prompt in enumerate(prompts):
        for j in range(params.n):
            gen = row_generator(params.seed, j, device) if params.seed is not None else None
            rows.append(
                Row(
                    prompt_key=first_key + i, prompt_index=i, sample_index=j, prompt=prompt, params=params,
                    stop_ids=stop_ids, max_tokens=min(params.max_tokens, max_len - len(prompt)),
                    sampling=sampling, generator=gen, cancel=cancel,
                    stop_strings=StopStrings(params.stop) if params.stop else None,
                )
            )
    return rows


def _row_params(rows: list[Row], vocab: int, device: torch.device) -> RowParams:
    return RowParams.of([r.sampling or sampling_state(r.params, vocab) for r in rows], vocab, device)


def _step_row(row: Row, token: int, logprob: float, tokenizer: Any) -> bool:
    """Take one sampled token into the row; True while the row goes on."""
    row.tokens.append(token)
    if row.params.logprobs is not None:
        row.logprobs.append(logprob)
    if token in row.stop_ids:
        row.finish, row.stopped_by_token = "stop", True
    elif row.stop_strings is not None and (cut := row.stop_strings.step(row.tokens, tokenizer)) is not None:
        row.finish, row.cut = "stop", cut
    elif len(row.tokens) >= row.max_tokens:
        row.finish = "length"
    else:
        return True
    return False


def _cancelled(row: Row) -> bool:
    return row.cancel is not None and row.cancel.is_set()


@torch.inference_mode()
def run_batch(
    model: Any,
    tokenizer: Any,
    rows: list[Row],
    *,
    device: torch.device,
    pad_id: int,
    shared: torch.Generator,
) -> None:
    """Generate every row to completion, in place."""
    from transformers import DynamicCache

    # Prefill each distinct prompt once, left-padded.
    keys = sorted({r.prompt_key for r in rows})
    prompt_of = {r.prompt_key: r.prompt for r in rows}
    width = max(len(prompt_of[k]) for k in keys)
    ids = torch.full((len(keys), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(keys), width), dtype=torch.long)
    for b, k in enumerate(keys):
        p = prompt_of[k]
        ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # transformers builds masks with vmap on every forward, which costs more than the tiny model's
    # whole step; a ready 4D mask is used as given (sdpa and eager attention).
    own_mask = getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager")
    min_value = torch.finfo(model.dtype).min

    def attention(mask2d: torch.Tensor, queries: int) -> torch.Tensor:
        if not own_mask:
            return mask2d
        allowed = mask2d.bool()[:, None, None, :]
        if queries > 1:
            allowed = allowed & torch.ones(queries, queries, dtype=torch.bool, device=device).tril()[None, None]
        # A large negative number, not -inf: fully masked rows (left-padding queries) stay finite.
        return torch.zeros(allowed.shape, dtype=model.dtype, device=device).masked_fill_(~allowed, min_value)

    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=attention(mask, width), position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    # Expand prompts to rows (n samples share one prefill).
    slot = {k: b for b, k in enumerate(keys)}
    expand = torch.tensor([slot[r.prompt_key] for r in rows], device=device)
    cache.batch_select_indices(expand)
    logits = out.logits[:, -1, :][expand]
    mask, positions = mask[expand], positions[expand][:, -1:]

    vocab = logits.shape[-1]
    params = _row_params(rows, vocab, device)
    active = list(range(len(rows)))
    while True:
        tokens, logprobs = sample(logits, params, [rows[i].generator for i in active], shared)
        keep: list[int] = []
        for pos, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
            row = rows[active[pos]]
            if _cancelled(row):
                row.finish = "abort"
                continue
            try:
                if _step_row(row, token, logprob, tokenizer):
                    keep.append(pos)
            except Exception as exc:  # this row's own failure: it ends alone
                row.error, row.finish = exc, "abort"
        if not keep:
            return
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, positions, tokens = mask[index], positions[index], tokens[index]
            params = params.select(index)
            active = [active[p] for p in keep]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
        positions = positions + 1
        out = model(input_ids=tokens.unsqueeze(-1), attention_mask=attention(mask, 1), position_ids=positions,
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :]
