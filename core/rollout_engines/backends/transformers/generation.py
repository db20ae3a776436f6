"""The decode loop of the embedded engine: a continuously batched, left-padded KV cache and our
own sampler.

The running :class:`Batch` holds :class:`Row` objects (one per prompt x sample) of any number of
requests, each with its own sampling parameters, their KV cache (left-padded to a common width)
and, for every row, the logits of its next token. Rows join and leave it between any two steps:

- :func:`run_batch` prefills new rows (each distinct context once; the ``n`` samples of a prompt
  share that prefill) and merges them into the running batch (the shorter cache is left-padded);
- :meth:`Batch.step` samples one token for every row and feeds the rows that go on; finished rows
  leave the cache at once, and columns that became padding for every row are trimmed;
- :meth:`Batch.split` takes rows out with their own KV (a stream whose consumer is behind, see
  the engine) and :meth:`Batch.extend` puts them back.

A row's context is its prompt, the tokens of the completion it continues (``continue_from``) and
the tokens generated so far; a row whose KV was dropped (a weight change, sleep) is prefilled
again from that context and carries on. Every generated token records the weight version of the
forward pass that produced its logits (``Row.versions``). A row may carry a LoRA adapter
(``Row.lora``, see :mod:`.lora`): every forward tells the model's hooks which rows use which.

Logprobs are "raw": ``log_softmax`` of the model's logits, before temperature, top-k/top-p/min-p
(as vLLM returns by default); the sampled token's logprob, the top-k lists and prompt logprobs all
come from that same distribution.

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

import contextlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...types import Completion, FinishReason, SamplingParams, TokenLogprob
from .sampling import RowParams, RowSampling, row_generator, sample, sampling_state

if TYPE_CHECKING:
    from .lora import Adapter, LoraLayers

TopList = list[tuple[int, float]]

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



@dataclass(eq=False)
class Row:
    """One sequence being generated (a prompt's ``sample_index``-th sample)."""

    prompt_key: int  # rows with the same key share a context (and its prefill) until they generate
    prompt_index: int
    sample_index: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    max_tokens: int  # new tokens; already capped by the context window
    sampling: RowSampling | None = None  # checked per request; None: built from params in the batch
    generator: torch.Generator | None = None
    cancel: threading.Event | None = None  # set: the request was cancelled, drop the row
    tokens: list[int] = field(default_factory=list)  # generated here (not the continued ones)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    stopped_by_token: bool = False
    cut: int | None = None  # where a stop string starts in the decoded text (of the new tokens)
    stop_strings: StopStrings | None = None
    error: BaseException | None = None  # a failure of this row alone
    request_id: str = ""
    index: int = 0  # position in its request (prompt-major)
    prior: Completion | None = None  # the earlier completion this row continues
    versions: list[int] = field(default_factory=list)  # weight version of every generated token
    top: list[TopList] | None = None  # per generated token: top-k (id, logprob), sampled one included
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[TopList] | None = None
    logits_version: int = 0  # the weight version that computed the row's pending logits
    prefills: int = 0  # times its context was prefilled (more than once: its KV was dropped)
    owner: Any = None  # the engine's request
    lora: Adapter | None = None  # the adapter version the row runs with, taken when admitted
    parked: Batch | None = None  # taken out of the running batch with its own KV
    visible: int = 0  # streaming: tokens published to the consumer / taken by it / final published
    delivered: int = 0
    done: bool = False
    final_sent: bool = False

    def context(self) -> list[int]:
        prior = list(self.prior.token_ids) if self.prior is not None else []
        return self.prompt + prior + self.tokens

    def all_versions(self) -> list[int]:
        return (self.prior.versions() if self.prior is not None else []) + self.versions

    def completion(self, tokenizer: Any, version: int) -> Completion:
        kept = self.tokens[:-1] if self.stopped_by_token else self.tokens
        prior_ids = list(self.prior.token_ids) if self.prior is not None else []
        head = tokenizer.decode(prior_ids, skip_special_tokens=True) if prior_ids else ""
        whole = tokenizer.decode(prior_ids + kept, skip_special_tokens=True)
        text = whole[len(head):] if whole.startswith(head) else tokenizer.decode(kept, skip_special_tokens=True)
        if self.cut is not None:
            # Once per row: where the whole text has the stop string (the incremental text agrees
            # but for how an incomplete character was rendered).
            hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
            text = text[: min(hits) if hits else self.cut]
        versions = self.all_versions()
        logprobs = top = None
        if self.params.logprobs is not None:
            logprobs = list(self.prior.logprobs or []) if self.prior is not None else []
            logprobs += self.logprobs
        if self.top is not None:
            top = [list(t) for t in (self.prior.top_logprobs or [])] if self.prior is not None else []
            top += [[TokenLogprob(token_id=i, logprob=lp) for i, lp in entry] for entry in self.top]
        prompt_top = None
        if self.prompt_top is not None:
            prompt_top = [[TokenLogprob(token_id=i, logprob=lp) for i, lp in entry] for entry in self.prompt_top]
        return Completion(
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt),
            token_ids=prior_ids + list(self.tokens),
            text=head + text,
            logprobs=logprobs,
            top_logprobs=top,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            prompt_top_logprobs=prompt_top,
            finish_reason=self.finish or "length",
            weight_version=versions[-1] if versions else version,
            token_weight_versions=versions if len(set(versions)) > 1 else None,
            lora=self.lora.name if self.lora is not None else None,
            lora_version=self.lora.version if self.lora is not None else None,
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
    request_ids: list[str] | None = None,
    priors: list[Completion] | None = None,
    lora: Adapter | None = None,
) -> list[Row]:
    """Rows of one request, prompt-major (all samples of prompt 0 first).

    Everything that depends on the request's values alone is built here, so a request whose values
    cannot be used fails here rather than in the batch it would have joined. ``vocab``: check and
    clamp the sampling values for it now (else the batch does, for all its rows). ``priors``: the
    completion each prompt continues (``continue_from``); ``max_tokens`` counts new tokens.
    ``lora``: the adapter every row uses."""
    stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
    sampling = sampling_state(params, vocab) if vocab is not None else None
    rows: list[Row] = []
    for i, prompt in enumerate(prompts):
        prior = priors[i] if priors is not None else None
        room = max_len - len(prompt) - (len(prior.token_ids) if prior is not None else 0)
        for j in range(params.n):
            gen = row_generator(params.seed, j, device) if params.seed is not None else None
            index = len(rows)
            rows.append(
                Row(
                    prompt_key=first_key + i, prompt_index=i, sample_index=j, prompt=prompt, params=params,
                    stop_ids=stop_ids, max_tokens=min(params.max_tokens, room),
                    sampling=sampling, generator=gen, cancel=cancel,
                    stop_strings=StopStrings(params.stop) if params.stop else None,
                    request_id=request_ids[index] if request_ids is not None else "", index=index, prior=prior,
                    top=[] if params.top_logprobs is not None else None, lora=lora,
                )
            )
    return rows


def _row_params(rows: list[Row], vocab: int, device: torch.device) -> RowParams:
    return RowParams.of([r.sampling or sampling_state(r.params, vocab) for r in rows], vocab, device)


def _with_token(entry: TopList, token: int, logprob: float) -> TopList:
    """A top-k list that contains ``token`` (added last when it is not among the k)."""
    return entry if any(i == token for i, _ in entry) else [*entry, (token, logprob)]


def _step_row(row: Row, token: int, logprob: float, tokenizer: Any, top: TopList | None = None) -> bool:
    """Take one sampled token into the row; True while the row goes on."""
    row.tokens.append(token)
    row.versions.append(row.logits_version)
    if row.params.logprobs is not None:
        row.logprobs.append(logprob)
    if row.top is not None:
        row.top.append(_with_token(top or [], token, logprob))
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


def _adapters(lora: LoraLayers | None, rows: list[Row]) -> contextlib.AbstractContextManager[None]:
    """The context of one forward over ``rows`` (in batch order): which rows use which adapter."""
    if lora is None or all(r.lora is None for r in rows):
        return contextlib.nullcontext()
    return lora.rows([r.lora for r in rows])


# ---- the KV cache -------------------------------------------------------------------------------
KV = list[tuple[torch.Tensor, torch.Tensor]]


def _kv_of(cache: Any) -> KV:
    """Per layer (keys, values), each ``[rows, heads, length, head_dim]`` (old and new cache APIs)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _cache_of(kv: KV) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


_CACHE_KWARG: dict[type[Any], str] = {}


def _cache_kwarg(model_type: type[Any]) -> str:
    """The name under which ``model_type``'s forward takes the KV cache: ``cache`` in transformers
    releases that renamed it (``past_key_values`` is deprecated there, to go in 5.40), else
    ``past_key_values`` (a model's forward takes ``**kwargs``, which would swallow an unknown
    ``cache`` and run without one)."""
    name = _CACHE_KWARG.get(model_type)
    if name is None:
        params = inspect.signature(model_type.forward).parameters
        name = _CACHE_KWARG[model_type] = "cache" if "cache" in params else "past_key_values"
    return name


def _attention(model: Any, mask2d: torch.Tensor, queries: int) -> torch.Tensor:
    # transformers builds masks with vmap on every forward, which costs more than the tiny model's
    # whole step; a ready 4D mask is used as given (sdpa and eager attention).
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return mask2d
    allowed = mask2d.bool()[:, None, None, :]
    if queries > 1:
        width = mask2d.shape[-1]
        causal = torch.ones(queries, width, dtype=torch.bool, device=mask2d.device).tril(width - queries)
        allowed = allowed & causal[None, None]
    # A large negative number, not -inf: fully masked rows (left-padding queries) stay finite.
    return torch.zeros(allowed.shape, dtype=model.dtype, device=mask2d.device).masked_fill_(
        ~allowed, torch.finfo(model.dtype).min)


class Batch:
    """The running rows: their KV cache (left-padded), attention mask and next-token logits."""

    def __init__(self, device: torch.device, vocab: int) -> None:
        self.device, self.vocab = device, vocab
        self.rows: list[Row] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [rows, width], 1 where the cache holds a real token
        self.logits: torch.Tensor | None = None  # [rows, vocab], float32
        self.params: RowParams | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def clear(self) -> None:
        self.rows, self.cache, self.mask, self.logits, self.params = [], None, None, None, None

    def _set(self, rows: list[Row], kv: KV, mask: torch.Tensor, logits: torch.Tensor) -> None:
        if not rows:
            self.clear()
            return
        # Columns that are padding for every row (their longest row left) are cut off.
        lead = int((mask.cumsum(-1) == 0).sum(-1).min())
        if lead:
            kv = [(k[..., lead:, :], v[..., lead:, :]) for k, v in kv]
            mask = mask[:, lead:]
        self.rows, self.cache, self.mask, self.logits = rows, _cache_of(kv), mask, logits
        self.params = _row_params(rows, self.vocab, self.device)

    def keep(self, positions: list[int]) -> None:
        """Keep only the rows at ``positions`` (in that order)."""
        if len(positions) == len(self.rows):
            return
        if not positions:
            self.clear()
            return
        assert self.mask is not None and self.logits is not None
        index = torch.tensor(positions, device=self.device)
        kv = [(k[index], v[index]) for k, v in _kv_of(self.cache)]
        self._set([self.rows[p] for p in positions], kv, self.mask[index], self.logits[index])

    def split(self, positions: list[int]) -> list[Batch]:
        """Take the rows at ``positions`` out, each as a batch of its own (its KV copied out)."""
        assert self.mask is not None and self.logits is not None
        kv = _kv_of(self.cache)
        out = []
        for p in positions:
            one = Batch(self.device, self.vocab)
            one._set([self.rows[p]], [(k[p:p + 1].clone(), v[p:p + 1].clone()) for k, v in kv],
                     self.mask[p:p + 1].clone(), self.logits[p:p + 1].clone())
            out.append(one)
        taken = set(positions)
        self.keep([i for i in range(len(self.rows)) if i not in taken])
        return out

    def extend(self, others: list[Batch]) -> None:
        """Merge other batches' rows into this one (left-padding the shorter caches)."""
        parts = [b for b in ([self] if self.rows else []) + others if b.rows]
        if not parts or parts == [self]:
            return
        width = max(int(b.mask.shape[-1]) for b in parts)  # type: ignore[union-attr]
        kvs = [_kv_of(b.cache) for b in parts]
        layers = []
        for layer in range(len(kvs[0])):
            ks, vs = [], []
            for kv in kvs:
                k, v = kv[layer]
                pad = width - k.shape[-2]
                if pad:
                    k = torch.cat([k.new_zeros(*k.shape[:-2], pad, k.shape[-1]), k], dim=-2)
                    v = torch.cat([v.new_zeros(*v.shape[:-2], pad, v.shape[-1]), v], dim=-2)
                ks.append(k)
                vs.append(v)
            layers.append((torch.cat(ks), torch.cat(vs)))
        masks = []
        for b in parts:
            m = b.mask
            assert m is not None
            if m.shape[-1] < width:
                m = torch.cat([m.new_zeros(m.shape[0], width - m.shape[-1]), m], dim=-1)
            masks.append(m)
        logits = torch.cat([b.logits for b in parts])  # type: ignore[misc]
        self._set([r for b in parts for r in b.rows], layers, torch.cat(masks), logits)

    @torch.inference_mode()
    def step(self, model: Any, tokenizer: Any, shared: torch.Generator, version: int,
             lora: LoraLayers | None = None) -> list[Row]:
        """Sample one token for every row, then feed the rows that go on (their next logits come
        from weights ``version``; rows with an adapter through ``lora``'s hooks). Returns the rows
        that finished (they left the batch)."""
        assert self.logits is not None and self.params is not None and self.mask is not None
        rows = self.rows
        tokens, logprobs = sample(self.logits, self.params, [r.generator for r in rows], shared)
        k = max((r.params.top_logprobs for r in rows if r.params.top_logprobs), default=0)
        tops: list[TopList] | None = None
        if k:
            values, ids = self.logits.float().log_softmax(-1).topk(min(k, self.logits.shape[-1]), dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        keep: list[int] = []
        finished: list[Row] = []
        for pos, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
            row = rows[pos]
            if _cancelled(row):
                row.finish = "abort"
                finished.append(row)
                continue
            top = tops[pos][: row.params.top_logprobs or 0] if tops is not None else None
            try:
                if _step_row(row, token, logprob, tokenizer, top):
                    keep.append(pos)
                else:
                    finished.append(row)
            except Exception as exc:  # this row's own failure: it ends alone
                row.error, row.finish = exc, "abort"
                finished.append(row)
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=self.device, dtype=torch.long)
            tokens = tokens[index]
            self.keep(keep)
        if not self.rows:
            return finished
        assert self.mask is not None
        positions = self.mask.sum(-1, keepdim=True)  # the new token follows every real one
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=-1)
        with _adapters(lora, self.rows):
            out = model(input_ids=tokens.unsqueeze(-1), attention_mask=_attention(model, self.mask, 1),
                        position_ids=positions, use_cache=True, **{_cache_kwarg(type(model)): self.cache})
        self.logits = out.logits[:, -1, :].float()
        for row in self.rows:
            row.logits_version = version
        return finished


def _prefill_key(row: Row) -> tuple[int, int]:
    # Fresh rows of one prompt share a context; a row that generated already has its own.
    return (row.prompt_key, id(row) if row.tokens else 0)


def _prompt_logprobs(lsm: torch.Tensor, prompt: list[int], k: int) -> tuple[list[float], list[TopList]]:
    """Logprobs of ``prompt[1:]`` from ``lsm`` (``[len(prompt) - 1, vocab]``: position j predicts
    token j + 1), and the ``k`` most likely tokens at every such position."""
    if len(prompt) < 2:
        return [], []
    target = torch.tensor(prompt[1:], device=lsm.device, dtype=torch.long)
    values = lsm.gather(-1, target.unsqueeze(-1)).squeeze(-1).tolist()
    if not k:
        return values, []
    tv, ti = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
    return values, [list(zip(ids, vals, strict=True)) for ids, vals in zip(ti.tolist(), tv.tolist(), strict=True)]


@torch.inference_mode()
def run_batch(
    model: Any,
    tokenizer: Any,
    rows: list[Row],
    *,
    batch: Batch,
    pad_id: int,
    version: int = 0,
    lora: LoraLayers | None = None,
) -> None:
    """Prefill ``rows`` (each distinct context once, left-padded) and merge them into ``batch``,
    where they are stepped with the rows already running. Rows that asked for prompt logprobs get
    them here (the first time they are prefilled)."""
    from transformers import DynamicCache

    device = batch.device
    groups: dict[tuple[int, int], list[Row]] = {}
    for r in rows:
        groups.setdefault(_prefill_key(r), []).append(r)
    members = list(groups.values())
    contexts = [g[0].context() for g in members]
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for b, c in enumerate(contexts):
        ids[b, width - len(c):] = torch.tensor(c, dtype=torch.long)
        mask[b, width - len(c):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    want_prompt = [g for g in members if any(r.params.prompt_logprobs is not None and r.prompt_logprobs is None
                                            for r in g)]
    cache = DynamicCache()
    with _adapters(lora, [g[0] for g in members]):  # a group is one request's rows: one adapter
        out = model(input_ids=ids, attention_mask=_attention(model, mask, width), position_ids=positions,
                    use_cache=True, **{_cache_kwarg(type(model)): cache},
                    **({} if want_prompt else {"logits_to_keep": 1}))
    for b, g in enumerate(members):
        if g not in want_prompt:
            continue
        p = g[0].prompt
        start = width - len(contexts[b])
        lsm = out.logits[b, start:start + len(p) - 1, :].float().log_softmax(-1)
        k = max(r.params.prompt_logprobs or 0 for r in g)
        values, tops = _prompt_logprobs(lsm, p, k)
        for r in g:
            n = r.params.prompt_logprobs or 0
            r.prompt_logprobs = [None, *values]
            if n:  # the first prompt token has nothing before it: an empty list
                r.prompt_top = [[]] + [_with_token(t[:n], p[j + 1], values[j]) for j, t in enumerate(tops)]
    order = [r for g in members for r in g]
    slot = [b for b, g in enumerate(members) for _ in g]
    logits = out.logits[:, -1, :].float()
    if slot != list(range(len(members))):
        expand = torch.tensor(slot, device=device)
        cache.batch_select_indices(expand)
        mask, logits = mask[expand], logits[expand]
    for r in order:
        r.logits_version = version
    new = Batch(device, batch.vocab)
    new._set(order, _kv_of(cache), mask, logits)
    batch.extend([new])
