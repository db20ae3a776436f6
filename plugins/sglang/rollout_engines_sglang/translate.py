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
``n``                         the prompt is repeated ``n`` times with ``n=1`` each, so the
                              order of outputs is prompt-major by construction
============================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_engines import backend_kit
from rollout_engines.tokenization import chat_token_ids
from rollout_engines.types import Completion, FinishReason, GenerateRequest, SamplingParams


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
    """Request-level logprob arguments of ``Engine.async_generate``."""
    if s.logprobs is None:
        return {"return_logprob": False}
    # -1: start at the first generated token, so no prompt logprobs are computed.
    return {"return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": s.logprobs}


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


def generate_kwargs(request: GenerateRequest, prompts: Sequence[list[int]]) -> dict[str, Any]:
    """Keyword arguments of one batched ``sglang.Engine.async_generate`` call."""
    s = request.sampling
    expanded = expand_prompts(prompts, s.n)
    one = sampling_params(s)
    return {
        "input_ids": expanded,
        "sampling_params": [dict(one) for _ in expanded],
        **logprob_kwargs(s),
    }


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
