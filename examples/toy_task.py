"""The task both RL examples (``toy_rl.py``, ``async_rl.py``) train on, its policy gradient, and
how an example runs and reports.

The trainer is its own copy of the model; the prompts are random token ids; the reward of a
completion is the fraction of its tokens equal to a target token (by default the one the untrained
model likes most at the prompts' ends: still rare, about 0.3 %). The gradient terms are REINFORCE
with reward-to-go (the reward is a sum over tokens, so each token is credited with the target
tokens at or after it) and a per-position batch-mean baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Sample(Protocol):
    """What the gradient needs of a completion: its prompt and its tokens."""

    prompt_index: int
    token_ids: list[int]


@dataclass
class Task:
    path: str  # the model directory the engine loads
    trainer: Any  # the trainer's copy of the model, in train mode
    prompts: list[list[int]]
    target: int


def make_task(model: str | None, n_prompts: int, seed: int, target: int | None = None) -> Task:
    """Load the trainer's copy of ``model`` (default: the tiny test model), draw ``n_prompts``
    prompts of 6 tokens and choose the target token."""
    from transformers import AutoModelForCausalLM

    path = model
    if path is None:
        from rollout_engines.testing.tiny_model import tiny_model_path

        path = str(tiny_model_path())
    torch.manual_seed(seed)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer.train()
    gen = torch.Generator().manual_seed(seed)
    vocab = trainer.get_input_embeddings().weight.shape[0]
    prompts = torch.randint(10, vocab - 10, (n_prompts, 6), generator=gen).tolist()
    if target is None:
        with torch.no_grad():
            target = int(trainer(torch.tensor(prompts)).logits[:, -1].softmax(-1).mean(0).argmax())
    return Task(path=path, trainer=trainer, prompts=prompts, target=target)


def policy_terms(model: Any, prompts: list[list[int]], samples: Sequence[Sample],
                 target: int) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Per generated token (rows: samples, columns: positions): the model's log-probability of it
    and its advantage; and each sample's reward. All samples have the same number of tokens."""
    hits = [torch.tensor([float(t == target) for t in s.token_ids]) for s in samples]
    rewards = [float(h.mean()) for h in hits]
    # Reward-to-go per generated token (target hits at or after it, normalised like the reward).
    togo = torch.stack([h.flip(0).cumsum(0).flip(0) / len(h) for h in hits])
    advantage = togo - togo.mean(0, keepdim=True)
    seqs = [torch.tensor(prompts[s.prompt_index] + s.token_ids) for s in samples]
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    logits = model(ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    n_gen = togo.shape[1]
    starts = [len(prompts[s.prompt_index]) - 1 for s in samples]
    gen_logp = torch.stack([logp[i, s : s + n_gen] for i, s in enumerate(starts)])
    return gen_logp, advantage, rewards


def run_example(train: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]], args: argparse.Namespace,
                line: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """Run ``train(args)`` and print its summary: as JSON with ``--json``, else as ``line(summary)``."""
    summary = asyncio.run(train(args))
    print(json.dumps(summary) if args.json else line(summary))
    return summary
