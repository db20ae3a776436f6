"""Requests to SGLang and SGLang's outputs back, as pure functions (no SGLang, no GPU needed).

The core's :class:`~rollout_engines.types.SamplingParams` uses vLLM's names and meanings; SGLang's
``sampling_params`` dict differs in a few places:

============================  ==========================================================
core field                    SGLang
============================  ==========================================================
``temperature``               ``temperature`` (0 means greedy in both)
``top_p``                     ``top_p``
``top_k`` (-1 = off)          ``top_k`` (-1 = off; SGLang turns it into "all tokens")
``min_p``                     ``min_p``
``max_tokens``                ``max_new_tokens``
``stop``                      ``stop`` (the matched string is trimmed from the text, as vLLM)
``stop_token_ids``            ``stop_token_ids``; with ``ignore_eos`` SGLang skips its stop-token
                              check entirely, so the ids are not sent and the output is cut
                              after the first of them here (vLLM's meaning: ignore only EOS)
``ignore_eos``                ``ignore_eos``
``seed``                      ``sampling_seed`` (honoured only when the engine runs with
                              ``enable_deterministic_inference``; otherwise refused up front)
``logprobs``                  request-level ``return_logprob=True`` with
                              ``logprob_start_len=-1`` (no prompt logprobs) and
                              ``top_logprobs_num=logprobs``; the sampled token's logprob
                              comes back in ``meta_info['output_token_logprobs']``
``top_logprobs``              ``top_logprobs_num`` (shared with the prompt's; trimmed here);
                              ``meta_info['output_top_logprobs']``, one list of
                              (logprob, token_id, text) per generated token; the sampled
                              token is added where it is not among them
``prompt_logprobs``           ``logprob_start_len=0``: ``meta_info['input_token_logprobs']``
                              (the first entry's logprob is None) and
                              ``input_top_logprobs``
``n``                         the prompt is repeated ``n`` times with ``n=1`` each, so the
                              order of outputs is prompt-major by construction
``GenerateRequest.lora``      request-level ``lora_path``, one entry per sequence: the name
                              the adapter's current version is registered under in SGLang
                              (see :mod:`.lora`)
============================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_engines import backend_kit
from rollout_engines.tokenization import chat_token_ids
from rollout_engines.types import Completion, FinishReason, GenerateRequest, SamplingParams, TokenLogprob


def sampling_params(s: SamplingParams) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict for one sample of the core's :class:`SamplingParams`."""
    out: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "max_new_tokens": s.max_tokens,
        "ignore_eos": s.ignore_eos,
        # n is expanded by the caller (see expand_prompts): SGLang gets one sample per entry.
        "n": 1,
    }
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids and not s.ignore_eos:  # with ignore_eos: cut in to_completions
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        out["sampling_seed"] = s.seed
    return out


def logprob_kwargs(s: SamplingParams) -> dict[str, Any]:
    """Request-level logprob arguments of ``Engine.async_generate`` (``return_logprob``,
    ``logprob_start_len``, ``top_logprobs_num``: python/sglang/srt/entrypoints/engine.py)."""
    if s.logprobs is None and s.top_logprobs is None and s.prompt_logprobs is None:
        return {"return_logprob": False}
    # One top_logprobs_num serves the output and the prompt; each is trimmed to its own k.
    top = max(s.logprobs or 0, s.top_logprobs or 0, s.prompt_logprobs or 0)
    # -1: start at the first generated token, so no prompt logprobs are computed; 0: from the
    # first prompt token on (prompt logprobs).
    start = 0 if s.prompt_logprobs is not None else -1
    return {"return_logprob": True, "logprob_start_len": start, "top_logprobs_num": top}


def tokenize_request(request: GenerateRequest, tokenizer: Any) -> list[list[int]]:
    """The prompt token ids of every prompt of ``request`` (chat templates applied); checked by the
    core's :func:`~rollout_engines.backend_kit.validate_prompts` afterwards."""
    if request.prompt_token_ids is not None:
        return [list(p) for p in request.prompt_token_ids]
    if request.prompts is not None:
        out = [list(tokenizer.encode(p, add_special_tokens=True)) for p in request.prompts]
    else:
        assert request.messages is not None
        out = []
        for chat in request.messages:
            out.append(chat_token_ids(tokenizer, chat))
    return out


def expand_prompts(prompts: Sequence[list[int]], n: int) -> list[list[int]]:
    """Each prompt ``n`` times in a row (prompt-major), the order completions are returned in."""
    return [list(p) for p in prompts for _ in range(n)]


def model_inputs(request: GenerateRequest, prompts: Sequence[list[int]]) -> list[list[int]]:
    """What SGLang is given per prompt: the prompt, followed by the tokens of the completion it
    continues (``continue_from``; n is 1 then), so SGLang prefills both and generates on."""
    if request.continue_from is None:
        return [list(p) for p in prompts]
    return [list(p) + list(c.token_ids) for p, c in zip(prompts, request.continue_from, strict=True)]


def generate_kwargs(
    request: GenerateRequest, prompts: Sequence[list[int]], rids: Sequence[str] | None = None,
    lora_path: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments of one batched ``sglang.Engine.async_generate`` call; ``rids``: SGLang's
    ``rid`` of every prompt x sample (prompt-major), the ids abort_request takes; ``lora_path``: the
    SGLang name of the adapter version every sequence runs on."""
    s = request.sampling
    expanded = expand_prompts(model_inputs(request, prompts), s.n)
    one = sampling_params(s)
    out = {
        "input_ids": expanded,
        "sampling_params": [dict(one) for _ in expanded],
        **logprob_kwargs(s),
    }
    if rids is not None:
        if len(rids) != len(expanded):
            raise ValueError(f"{len(rids)} request ids for {len(expanded)} sequences")
        out["rid"] = list(rids)
    if lora_path is not None:
        out["lora_path"] = [lora_path] * len(expanded)
    return out


def continuation_kwargs(kwargs: Mapping[str, Any], picks: Sequence[tuple[int, list[int], str]]) -> dict[str, Any]:
    """The ``async_generate`` arguments that continue some sequences of the call made with
    ``kwargs`` as new SGLang requests: ``picks`` holds, per sequence, its place in that call, the
    tokens it has made so far and its new rid. Each is given its input + those tokens (SGLang
    prefills them under the weights current now) and what is left of its token budget; no prompt
    logprobs again (the first request returned them)."""
    out: dict[str, Any] = {k: v for k, v in kwargs.items() if not isinstance(v, list)}
    out["input_ids"] = [list(kwargs["input_ids"][k]) + list(made) for k, made, _ in picks]
    params = []
    for k, made, _ in picks:
        sp = dict(kwargs["sampling_params"][k])
        sp["max_new_tokens"] = max(1, int(sp["max_new_tokens"]) - len(made))
        if sp.get("min_new_tokens"):
            sp["min_new_tokens"] = max(0, int(sp["min_new_tokens"]) - len(made))
        params.append(sp)
    out["sampling_params"] = params
    out["rid"] = [rid for _, _, rid in picks]
    if "lora_path" in kwargs:
        out["lora_path"] = [kwargs["lora_path"][k] for k, _, _ in picks]
    if out.get("return_logprob") and out.get("logprob_start_len", -1) >= 0:
        out["logprob_start_len"] = -1
    return out


def finish_reason(meta_info: Mapping[str, Any]) -> FinishReason:
    """SGLang's ``meta_info['finish_reason']`` (a dict with 'type', or None: cut off, e.g. at
    shutdown) as the core's value."""
    return backend_kit.finish_reason(meta_info.get("finish_reason"))


def cut_at_stop_token(token_ids: list[int], stop_token_ids: Sequence[int]) -> int | None:
    """Where an output must end (after its first stop token), or None when it has none."""
    stops = set(stop_token_ids)
    for i, t in enumerate(token_ids):
        if t in stops:
            return i + 1
    return None


def ended_before_abort(
    token_ids: Sequence[int], sampling: SamplingParams, eos_token_ids: Sequence[int],
    decode: Callable[[list[int]], str],
) -> dict[str, Any] | None:
    """The finish reason of a sequence SGLang reported aborted although its tokens already end it,
    else None. SGLang's abort of a running request still runs one decode step and
    ``Req.check_finished`` tests ``to_abort`` before the length, stop-token and stop-string checks
    (python/sglang/srt/managers/schedule_batch.py), so the token of that step may have been its
    budget's last, EOS, a stop token or the end of a stop string: such a sequence is done, not to
    be continued (``token_ids``: its tokens, those of ``continue_from`` not included)."""
    if not token_ids:
        return None
    if len(token_ids) >= sampling.max_tokens:
        return {"type": "length", "length": sampling.max_tokens}
    last = int(token_ids[-1])
    if not sampling.ignore_eos and (last in set(sampling.stop_token_ids) or last in set(eos_token_ids)):
        return {"type": "stop", "matched": last}
    if sampling.stop:
        text = decode(list(token_ids))
        matched = next((s for s in sampling.stop if s in text), None)
        if matched is not None:
            return {"type": "stop", "matched": matched}
    return None


def to_completions(
    outputs: Sequence[Mapping[str, Any]] | Mapping[str, Any],
    prompts: Sequence[list[int]],
    sampling: SamplingParams,
    weight_version: int,
    decode: Callable[[list[int]], str] | None = None,
) -> list[Completion]:
    """SGLang's outputs (one per expanded prompt, in request order) as the core's completions.
    ``decode`` renders the text of an output cut at a stop token (see :func:`sampling_params`)."""
    if isinstance(outputs, Mapping):
        outputs = [outputs]
    n = sampling.n
    if len(outputs) != len(prompts) * n:
        raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(prompts)} prompts x n={n}")
    completions = []
    for k, out in enumerate(outputs):
        meta = out.get("meta_info", {})
        logprobs = None
        if sampling.logprobs is not None:
            # Entries are (logprob, token_id, text-or-None), one per generated token.
            logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        prompt_index = k // n
        token_ids, text, reason = list(out.get("output_ids") or []), out.get("text") or "", finish_reason(meta)
        cut = cut_at_stop_token(token_ids, sampling.stop_token_ids) if sampling.ignore_eos else None
        if cut is not None:
            # As vLLM: the stop token ends the output and is not part of its text.
            token_ids, reason = token_ids[:cut], "stop"
            logprobs = logprobs[:cut] if logprobs is not None else None
            text = decode(token_ids[:-1]) if decode is not None else text
        completions.append(
            Completion(
                prompt_index=prompt_index,
                sample_index=k % n,
                prompt_token_ids=list(prompts[prompt_index]),
                token_ids=token_ids,
                text=text,
                logprobs=logprobs,
                finish_reason=reason,
                weight_version=weight_version,
            )
        )
    return completions


# ---- streaming and the logprobs SGLang returns with it ---------------------------------------------
class SequenceOutput:
    """One sequence's output so far, built from SGLang's stream chunks.

    SGLang's chunks (python/sglang/srt/managers/tokenizer_manager.py, ``_handle_batch_output``)
    carry everything so far (``output_ids``, ``meta_info['output_token_logprobs']`` ...) unless
    SGLang runs with ``incremental_streaming_output``, when they carry only what is new; the final
    chunk has ``meta_info['finish_reason']`` set (a dict with 'type'), intermediate ones None.
    """

    def __init__(self, incremental: bool = False) -> None:
        self.incremental = incremental
        self.token_ids: list[int] = []
        self.text = ""
        self.logprob_entries: list[Any] = []  # (logprob, token_id, text) per token
        self.top_entries: list[Any] = []  # per token: a list of (logprob, token_id, text), or None
        self.versions: list[int] = []  # the engine's weight version when each token arrived
        self.input_entries: list[Any] | None = None
        self.input_top_entries: list[Any] | None = None
        self.finish: Any = None
        self.finished = False
        #: Tokens made by earlier SGLang requests of this sequence (see :meth:`resubmitted`): the
        #: chunks of the current one count from there.
        self.base = 0
        self._decode: Callable[[list[int]], str] | None = None

    def resubmitted(self, decode: Callable[[list[int]], str]) -> None:
        """The sequence goes on as a new SGLang request (prompt + the tokens so far, see
        :func:`continuation_kwargs`): its chunks count from the tokens already here, and the text
        is decoded from all tokens at the end (SGLang's text covers only its own request)."""
        self.base = len(self.token_ids)
        self._decode = decode

    def absorb(self, chunk: Mapping[str, Any], version: int) -> tuple[int, int]:
        """Take one chunk; returns the [start, end) range of the tokens it added."""
        meta = chunk.get("meta_info") or {}
        ids = list(chunk.get("output_ids") or [])
        start = len(self.token_ids)
        lps = list(meta.get("output_token_logprobs") or [])
        tops = list(meta.get("output_top_logprobs") or [])
        if self.incremental:
            new = ids
            self.text += chunk.get("text") or ""
        else:
            seen = start - self.base
            new, lps, tops = ids[seen:], lps[seen:], tops[seen:]
            if chunk.get("text") is not None:
                self.text = chunk["text"]
        self.token_ids += new
        self.logprob_entries += lps
        self.top_entries += tops
        self.versions += [version] * len(new)
        if self.input_entries is None and meta.get("input_token_logprobs"):
            self.input_entries = list(meta["input_token_logprobs"])
        if self.input_top_entries is None and meta.get("input_top_logprobs"):
            self.input_top_entries = list(meta["input_top_logprobs"])
        if meta.get("finish_reason") is not None:
            self.finished, self.finish = True, meta["finish_reason"]
        return start, len(self.token_ids)

    def end(self, finish: Mapping[str, Any], decode: Callable[[list[int]], str]) -> None:
        """End the sequence here with ``finish`` (SGLang's format), its text decoded from its tokens
        and trimmed at the stop ``finish`` names (see :func:`ended_before_abort`)."""
        self.finished, self.finish, self._decode = True, dict(finish), decode

    def _decoded_text(self, decode: Callable[[list[int]], str]) -> str:
        """The text of a resubmitted sequence, decoded from all its tokens and trimmed at the stop
        its last SGLang request matched, as SGLang's detokenizer trims it
        (``DetokenizerManager.trim_matched_stop``: a matched stop token is left out of the decoded
        ids, a matched stop string and what follows it are cut from that request's text)."""
        matched = self.finish.get("matched") if isinstance(self.finish, Mapping) else None
        if isinstance(matched, int) and not isinstance(matched, bool) and len(self.token_ids) > self.base:
            return decode(self.token_ids[:-1])
        text = decode(self.token_ids)
        if isinstance(matched, str) and matched:
            # SGLang matches stop strings within its request's own output: look there first.
            pos = text.find(matched, len(decode(self.token_ids[: self.base])))
            if pos == -1:
                pos = text.rfind(matched)
            if pos != -1:
                text = text[:pos]
        return text

    def as_output(self) -> dict[str, Any]:
        """In the format of SGLang's non-streamed output (what :func:`to_completions` reads)."""
        text = self.text if self._decode is None else self._decoded_text(self._decode)
        return {
            "output_ids": list(self.token_ids), "text": text,
            "meta_info": {"finish_reason": self.finish, "output_token_logprobs": list(self.logprob_entries)},
        }


def logprob_values(entries: Sequence[Any]) -> list[float]:
    return [float(e[0]) for e in entries]


def top_list(entry: Any, k: int, sampled: int | None = None, sampled_logprob: float | None = None) -> list[TokenLogprob]:
    """One position's top logprobs (SGLang: a list of (logprob, token_id, text)), the ``k`` most
    likely, sorted, with the sampled token added when it is not among them."""
    items = [(float(e[0]), int(e[1])) for e in (entry or []) if e is not None and e[0] is not None]
    items.sort(key=lambda x: -x[0])
    items = items[:k]
    if sampled is not None and sampled_logprob is not None and sampled not in {t for _, t in items}:
        items.append((float(sampled_logprob), int(sampled)))
        items.sort(key=lambda x: -x[0])
    return [TokenLogprob(token_id=t, logprob=lp) for lp, t in items]


def top_lists(out: SequenceOutput, start: int, end: int, k: int) -> list[list[TokenLogprob]]:
    rows = []
    for j in range(start, end):
        entry = out.top_entries[j] if j < len(out.top_entries) else None
        lp = out.logprob_entries[j][0] if j < len(out.logprob_entries) else None
        rows.append(top_list(entry, k, out.token_ids[j], lp))
    return rows


def prompt_logprobs(out: SequenceOutput, prompt_len: int, k: int) -> tuple[list[float | None], list[list[TokenLogprob]] | None]:
    """The prompt's logprobs (first None) and, for ``k > 0``, its top ``k`` per position, from
    ``input_token_logprobs`` / ``input_top_logprobs`` (asked for with ``logprob_start_len=0``)."""
    entries = (out.input_entries or [])[:prompt_len]
    values: list[float | None] = [None if e is None or e[0] is None else float(e[0]) for e in entries]
    values += [None] * (prompt_len - len(values))
    if values:
        values[0] = None
    if k <= 0:
        return values, None
    tops = list(out.input_top_entries or [])[:prompt_len]
    tops += [None] * (prompt_len - len(tops))
    return values, [top_list(e, k) for e in tops]


def complete(
    c: Completion,
    out: SequenceOutput,
    sampling: SamplingParams,
    prompt_len: int,
    prior: Completion | None,
    request_id: str,
) -> Completion:
    """A completion of :func:`to_completions` (over ``out.as_output()``) with what the streamed
    output adds: top and prompt logprobs, the weight version of each token, the request id, and
    the tokens of the completion it continues (``prior``) in front."""
    n = len(c.token_ids)  # to_completions may have cut at a stop token
    versions = out.versions[:n]
    if sampling.top_logprobs is not None:
        c.top_logprobs = top_lists(out, 0, n, sampling.top_logprobs)
    if sampling.prompt_logprobs is not None:
        c.prompt_logprobs, c.prompt_top_logprobs = prompt_logprobs(out, prompt_len, sampling.prompt_logprobs)
    if prior is not None:
        c.token_ids = list(prior.token_ids) + c.token_ids
        c.text = prior.text + c.text
        if c.logprobs is not None:
            c.logprobs = list(prior.logprobs or []) + c.logprobs
        if c.top_logprobs is not None:
            c.top_logprobs = list(prior.top_logprobs or []) + c.top_logprobs
        versions = prior.versions() + versions
    if versions:
        c.weight_version = versions[-1]
        c.token_weight_versions = versions if len(set(versions)) > 1 else None
    c.request_id = request_id
    return c
