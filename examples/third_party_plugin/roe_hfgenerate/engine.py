"""A deliberately simple backend: ``model.generate()`` per prompt and sample.

It declares what it cannot do (no sleep, no prefix cache) and the core turns those calls into
clear ``CapabilityError``s; the conformance suite skips those tests on the declared flags.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import torch
from rollout_engines import Capabilities, Completion, Engine, EngineConfig, GenerateRequest
from rollout_engines.errors import InvalidRequest
from rollout_engines.tokenization import chat_token_ids
from rollout_engines.types import FinishReason
from rollout_engines.weights.manifest import TransportSpec, WeightManifest
from rollout_engines.weights.receiver import StateDictTarget, WeightReceiver
from transformers import AutoModelForCausalLM, AutoTokenizer

_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class HFGenerateEngine(Engine):
    backend_name = "hfgenerate"
    capabilities = Capabilities(
        chat=True, logprobs=True, n=True, stop_strings=True, seed=True, pause=True,
        transports=("inproc", "shm", "gloo", "disk"),
    )

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        dtype = _DTYPES[config.dtype]
        self.hf_model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype or "auto").eval()
        self._lock = threading.Lock()  # one generate() or weight load at a time
        self._receiver = WeightReceiver(StateDictTarget(self.hf_model), label="hfgenerate")

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        return await asyncio.to_thread(self._generate_sync, request)

    def _prompts(self, request: GenerateRequest) -> list[list[int]]:
        if request.prompt_token_ids is not None:
            prompts = request.prompt_token_ids
        elif request.prompts is not None:
            prompts = [self.tokenizer(p)["input_ids"] for p in request.prompts]
        else:
            assert request.messages is not None
            prompts = [chat_token_ids(self.tokenizer, chat) for chat in request.messages]
        vocab, window = self.hf_model.config.vocab_size, self.hf_model.config.max_position_embeddings
        for i, p in enumerate(prompts):
            if any(t >= vocab for t in p):
                raise InvalidRequest(f"prompt {i} has token ids >= the vocabulary size {vocab}")
            if len(p) + request.sampling.max_tokens > window:
                raise InvalidRequest(f"prompt {i} plus max_tokens exceeds the context window of {window} tokens")
        return prompts

    def _generate_sync(self, request: GenerateRequest) -> list[Completion]:
        s = request.sampling
        eos = [] if s.ignore_eos else [self.tokenizer.eos_token_id]
        stop_ids = set(eos + list(s.stop_token_ids))
        out: list[Completion] = []
        with self._lock, torch.no_grad():
            version = self.weight_version
            for i, prompt in enumerate(self._prompts(request)):
                for j in range(s.n):
                    if s.seed is not None:
                        torch.manual_seed(s.seed + j)
                    ids = torch.tensor([prompt])
                    result = self.hf_model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        do_sample=s.temperature > 0,
                        temperature=s.temperature if s.temperature > 0 else None,
                        top_p=s.top_p if s.temperature > 0 else None,
                        top_k=(s.top_k if s.top_k > 0 else 0) if s.temperature > 0 else None,
                        min_p=(s.min_p or None) if s.temperature > 0 else None,
                        max_new_tokens=s.max_tokens,
                        min_new_tokens=0,
                        eos_token_id=sorted(stop_ids) or None,
                        pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                        stop_strings=s.stop or None,
                        tokenizer=self.tokenizer if s.stop else None,
                        output_logits=True,
                        return_dict_in_generate=True,
                    )
                    tokens = result.sequences[0, len(prompt):].tolist()
                    logprobs = None
                    if s.logprobs is not None:
                        logits = torch.stack(result.logits, dim=1)[0].float()
                        logprobs = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
                    out.append(self._completion(i, j, prompt, tokens, logprobs, s.stop, stop_ids, s.max_tokens, version))
        return out

    def _completion(self, i: int, j: int, prompt: list[int], tokens: list[int], logprobs: list[float] | None,
                    stop: Sequence[str], stop_ids: set[int], max_tokens: int, version: int) -> Completion:
        text = str(self.tokenizer.decode(tokens, skip_special_tokens=True))
        finish: FinishReason = "length"
        if tokens and tokens[-1] in stop_ids:
            finish = "stop"
        hits = [text.find(st) for st in stop if st in text]
        if hits:
            text, finish = text[: min(hits)], "stop"
        elif len(tokens) < max_tokens:
            finish = "stop"
        return Completion(prompt_index=i, sample_index=j, prompt_token_ids=list(prompt), token_ids=tokens,
                          text=text, logprobs=logprobs, finish_reason=finish, weight_version=version)

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        await asyncio.to_thread(self._receiver.connect, spec)

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        def receive() -> None:
            with self._lock:
                self._receiver.receive(manifest)

        await asyncio.to_thread(receive)

    async def _close_weight_transfer(self) -> None:
        self._receiver.close()

    async def _close(self) -> None:
        self._receiver.close()
        self.hf_model = None
