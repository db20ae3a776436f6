"""A minimal real engine over a small ``torch.nn.Module`` (no transformers), for transport tests.

Its "generation" is greedy argmax over a one-layer bigram model, so any change of its weights
changes its outputs. It hosts the core's :class:`WeightReceiver` exactly like a real backend.
"""

from __future__ import annotations

import asyncio

import torch
from rollout_engines import Capabilities, Completion, Engine, EngineConfig, GenerateRequest
from rollout_engines.errors import WeightsInvalidated
from rollout_engines.weights.manifest import TransportSpec, WeightManifest
from rollout_engines.weights.receiver import StateDictTarget, WeightReceiver

VOCAB, HIDDEN = 64, 32


class Bigram(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mid = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def make_model(seed: int = 0) -> Bigram:
    torch.manual_seed(seed)
    return Bigram()


class ModuleEngine(Engine):
    backend_name = "module"
    capabilities = Capabilities(seed=True, pause=True, prefix_cache=True, transports=("inproc", "gloo", "shm", "disk"))

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.net = make_model(config.seed)
        self.receiver = WeightReceiver(
            StateDictTarget(self.net), mode=config.options.get("mode", "staged"), label="module engine"
        )
        self.cache_resets = 0  # a real engine drops its prefix cache here; this one counts

    async def _reset_prefix_cache(self) -> None:
        self.cache_resets += 1

    def _extra_info(self) -> dict[str, int]:
        return {"cache_resets": self.cache_resets}

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        assert request.prompt_token_ids is not None
        out = []
        with torch.no_grad():
            for i, prompt in enumerate(request.prompt_token_ids):
                tok, toks = prompt[-1] % VOCAB, []
                for _ in range(request.sampling.max_tokens):
                    tok = int(self.net(torch.tensor([tok])).argmax())
                    toks.append(tok)
                out.append(Completion(prompt_index=i, prompt_token_ids=prompt, token_ids=toks,
                                      finish_reason="length", weight_version=self.weight_version))
        return out

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        await asyncio.to_thread(self.receiver.connect, spec)

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        try:
            await asyncio.to_thread(self.receiver.receive, manifest)
        except WeightsInvalidated as exc:
            self._weights_invalid = str(exc)
            raise

    async def _close_weight_transfer(self) -> None:
        self.receiver.close()

    async def _close(self) -> None:
        self.receiver.close()
