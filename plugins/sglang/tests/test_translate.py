"""Request translation: every core SamplingParams field reaches SGLang's sampling_params, and
SGLang's outputs come back as the core's completions."""

from __future__ import annotations

import pytest
from rollout_engines.types import GenerateRequest, SamplingParams
from rollout_engines_sglang import translate


def test_every_sampling_field_is_mapped() -> None:
    s = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, max_tokens=33, stop=["</s>", "\n\n"],
        stop_token_ids=[2, 7], ignore_eos=False, seed=1234, logprobs=3, n=4,
    )
    out = translate.sampling_params(s)
    assert out == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "max_new_tokens": 33,
        "stop": ["</s>", "\n\n"], "stop_token_ids": [2, 7], "ignore_eos": False, "sampling_seed": 1234,
        "n": 1,
    }
    assert translate.logprob_kwargs(s) == {"return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 3}
    # Every field of the core's model is accounted for (a new field must be mapped here too).
    # Request-level logprob args (top_logprobs_num, logprob_start_len); prompt repetition.
    handled_elsewhere = {"logprobs", "top_logprobs", "prompt_logprobs", "n"}
    mapped = {"temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "seed"}
    assert set(SamplingParams.model_fields) == mapped | handled_elsewhere


def test_defaults_leave_optional_fields_out() -> None:
    out = translate.sampling_params(SamplingParams())
    assert "stop" not in out and "stop_token_ids" not in out and "sampling_seed" not in out
    assert out["top_k"] == -1 and out["max_new_tokens"] == 16
    assert translate.logprob_kwargs(SamplingParams()) == {"return_logprob": False}
    # logprobs=0: only the sampled token's logprob.
    assert translate.logprob_kwargs(SamplingParams(logprobs=0))["top_logprobs_num"] == 0
    # top_logprobs_num serves both; logprob_start_len=0 asks SGLang for the prompt's logprobs.
    assert translate.logprob_kwargs(SamplingParams(top_logprobs=2, prompt_logprobs=5)) == {
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5}


def test_n_is_expanded_prompt_major() -> None:
    req = GenerateRequest(prompt_token_ids=[[1, 2], [3]], sampling=SamplingParams(n=3, temperature=0.5))
    kw = translate.generate_kwargs(req, [[1, 2], [3]])
    assert kw["input_ids"] == [[1, 2]] * 3 + [[3]] * 3
    assert len(kw["sampling_params"]) == 6
    assert all(sp["n"] == 1 and sp["temperature"] == 0.5 for sp in kw["sampling_params"])
    # Separate dicts: SGLang normalises them in place.
    assert len({id(sp) for sp in kw["sampling_params"]}) == 6


def _out(ids: list[int], reason: dict | None, logprobs: list[float] | None = None) -> dict:
    meta: dict = {"finish_reason": reason}
    if logprobs is not None:
        meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(logprobs, ids, strict=True)]
    return {"text": f"t{ids}", "output_ids": ids, "meta_info": meta}


def test_outputs_become_completions() -> None:
    s = SamplingParams(n=2, logprobs=0)
    outputs = [
        _out([5, 6], {"type": "length", "length": 2}, [-0.5, -1.5]),
        _out([7], {"type": "stop", "matched": 2}, [-0.25]),
        _out([8, 9], {"type": "stop", "matched": "\n"}, [-1.0, -2.0]),
        _out([], {"type": "abort", "message": "x"}, []),
    ]
    comps = translate.to_completions(outputs, [[1, 2], [3]], s, weight_version=7)
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [c.finish_reason for c in comps] == ["length", "stop", "stop", "abort"]
    assert comps[0].token_ids == [5, 6] and comps[0].logprobs == [-0.5, -1.5]
    assert comps[2].prompt_token_ids == [3] and comps[0].prompt_token_ids == [1, 2]
    assert comps[1].text == "t[7]" and all(c.weight_version == 7 for c in comps)


def test_no_logprobs_requested_gives_none_and_count_mismatch_raises() -> None:
    comps = translate.to_completions(_out([1], {"type": "length"}), [[4]], SamplingParams(), 0)
    assert comps[0].logprobs is None
    with pytest.raises(RuntimeError, match="2 outputs for 1 prompts"):
        translate.to_completions([_out([1], None), _out([2], None)], [[4]], SamplingParams(), 0)
    assert translate.finish_reason({"finish_reason": None}) == "abort"


def test_tokenize_prompts_and_chats_with_the_model_tokenizer(tiny_model) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = translate.tokenize_request(GenerateRequest(prompts=["hello world"]), tok)
    assert ids == [tok.encode("hello world")]
    chat = [{"role": "user", "content": "hi there"}]
    ids = translate.tokenize_request(GenerateRequest(messages=[chat]), tok)
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ids == [tok.encode(rendered, add_special_tokens=False)]
    assert ids[0][-3:] != ids[0][:3]  # the template wrapped the message
    assert translate.tokenize_request(GenerateRequest(prompt_token_ids=[[3, 4]]), tok) == [[3, 4]]


def test_stop_token_ids_with_ignore_eos_are_cut_here() -> None:
    """SGLang's ignore_eos turns its whole stop-token check off; the core's meaning (vLLM's) only
    ignores EOS. So the ids are not sent, and the output ends after the first of them here."""
    s = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[9, 5], logprobs=0)
    out = translate.sampling_params(s)
    assert out["ignore_eos"] is True and "stop_token_ids" not in out
    full = {"output_ids": [4, 3, 5, 9, 5, 1, 1, 1], "text": "full text",
            "meta_info": {"finish_reason": {"type": "length"},
                          "output_token_logprobs": [[-0.1 * i, t, None] for i, t in enumerate([4, 3, 5, 9, 5, 1, 1, 1])]}}
    (comp,) = translate.to_completions([full], [[1]], s, 3, decode=lambda ids: "|".join(map(str, ids)))
    assert comp.token_ids == [4, 3, 5] and comp.finish_reason == "stop"
    assert comp.text == "4|3"  # the stop token is not part of the text, as in vLLM
    assert comp.logprobs == pytest.approx([0.0, -0.1, -0.2])
    # No stop token in the output: left as SGLang returned it.
    (comp,) = translate.to_completions([{**full, "output_ids": [1, 2]}], [[1]], s.model_copy(update={"logprobs": None}), 3)
    assert comp.token_ids == [1, 2] and comp.finish_reason == "length" and comp.text == "full text"


@pytest.mark.parametrize("matched", ["X", 14])
def test_text_of_a_resubmitted_sequence_is_trimmed_at_its_stop_as_sglang_trims_it(matched) -> None:
    """A sequence a ``keep`` pause resubmitted gets its text decoded from all its tokens; a stop
    string or stop token SGLang matched in the new request is not part of the text, as SGLang's
    detokenizer trims it (DetokenizerManager.trim_matched_stop) for a request never resubmitted."""
    vocab = {11: "a", 12: "b", 13: "c", 14: "X!", 15: "d"}

    def decode(ids: list[int]) -> str:
        return "".join(vocab[t] for t in ids)

    out = translate.SequenceOutput()
    out.absorb({"text": None, "output_ids": [11, 12], "meta_info": {"finish_reason": None}}, 0)
    out.resubmitted(decode)  # the keep pause ended SGLang's request; it goes on as a new one
    finish = {"type": "stop", "matched": matched}
    # SGLang's text of the new request: trimmed before the stop string / without the stop token.
    out.absorb({"text": "c", "output_ids": [13, 14], "meta_info": {"finish_reason": finish}}, 1)
    assert out.token_ids == [11, 12, 13, 14]
    assert out.as_output()["text"] == "abc"
    # Not finished at a stop: the text is every token's.
    plain = translate.SequenceOutput()
    plain.absorb({"text": None, "output_ids": [11], "meta_info": {"finish_reason": None}}, 0)
    plain.resubmitted(decode)
    plain.absorb({"text": "X!d", "output_ids": [14, 15], "meta_info": {"finish_reason": {"type": "length"}}}, 1)
    assert plain.as_output()["text"] == "aX!d"


def test_a_sequence_aborted_at_a_token_that_ends_it_is_finished_with_that_reason() -> None:
    """SGLang's abort of a running request runs one more decode step and reports 'abort' even where
    that step's token ended the sequence (Req.check_finished tests to_abort first): a ``keep``
    pause must not continue such a sequence past its budget, EOS, stop token or stop string."""
    vocab = {1: "a", 2: "b", 3: "<eos>", 4: "STOP"}

    def decode(ids: list[int]) -> str:
        return "".join(vocab[t] for t in ids)

    def ended(ids: list[int], **kw) -> dict | None:
        return translate.ended_before_abort(ids, SamplingParams(max_tokens=5, **kw), [3], decode)

    assert ended([1, 2]) is None and ended([]) is None
    assert ended([1, 2, 1, 2, 1]) == {"type": "length", "length": 5}
    assert ended([1, 3]) == {"type": "stop", "matched": 3}  # EOS
    assert ended([1, 3], ignore_eos=True) is None
    assert ended([1, 2], stop_token_ids=[2]) == {"type": "stop", "matched": 2}
    assert ended([1, 4], stop=["ST"]) == {"type": "stop", "matched": "ST"}
    # Ended there, its text is trimmed as SGLang trims a stop token or string.
    for ids, finish, text in (([1, 2], {"type": "stop", "matched": 2}, "a"),
                              ([1, 4], {"type": "stop", "matched": "ST"}, "a"),
                              ([1, 2], {"type": "length", "length": 2}, "ab")):
        out = translate.SequenceOutput()
        out.absorb({"text": None, "output_ids": ids, "meta_info": {"finish_reason": {"type": "abort"}}}, 0)
        out.end(finish, decode)
        assert out.finished and out.as_output()["text"] == text
        (comp,) = translate.to_completions([out.as_output()], [[9]], SamplingParams(max_tokens=5), 0)
        assert comp.finish_reason == ("length" if finish["type"] == "length" else "stop")
