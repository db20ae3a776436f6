"""A tiny REINFORCE loop whose reward rises only if the weight push really lands in the engine.

    python examples/toy_rl.py                          # engine in this process (inproc)
    python examples/toy_rl.py --transport shm          # engine in its own process
    python examples/toy_rl.py --transport gloo --json
    python examples/toy_rl.py --no-push                # control: the engine never learns
    python examples/toy_rl.py --transport gloo --delta --freeze-embeddings --json   # delta pushes

The engine samples completions; the trainer (its own copy of the model, a torch optimizer)
scores them with a verifiable reward (the fraction of output tokens equal to a target token),
takes one policy-gradient step and pushes the new weights to the engine. Sampling happens only
in the engine, so if the push did not arrive the reward would stay near zero: with
``--no-push`` it does.

The update is REINFORCE with reward-to-go (the reward is a sum over tokens, so each token is
credited with the target tokens at or after it) and a per-position batch-mean baseline.

Bytes: the JSON reports ``bytes_per_step`` (what a push after the first sent, on average),
``full_bytes_per_step`` (what a full push of the same state carries) and their ratio
``bytes_ratio``. With ``--delta`` pushes send only what changed since the last one
(:mod:`rollout_engines.weights.delta`; the first is full). Adam moves every element that has a
gradient, so with every parameter trained a delta saves nothing; ``--freeze-embeddings`` trains the
decoder layers only (the tied embedding / LM head, most of this model's bytes, stays as it is), and
the pushes then carry those layers alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams, connect_weight_sync, create_engine

if str(Path(__file__).resolve().parent) not in sys.path:  # the task module beside this file, also when a
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # test loads this file by its path
from toy_task import make_task, policy_terms, run_example  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", default="inproc", help="inproc (engine in this process), shm, gloo, disk")
    p.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--target-token", type=int, default=None, help="default: the model's most likely token at start")
    p.add_argument("--no-push", action="store_true", help="train but never push (the control run)")
    p.add_argument("--delta", action="store_true", help="push only what changed since the last push")
    p.add_argument("--freeze-embeddings", action="store_true",
                   help="do not train the (tied) embedding and LM head, only the decoder layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON summary last")
    return p.parse_args(argv)


def reinforce_loss(model: Any, prompts: list[list[int]], outs: list[Any], target: int) -> tuple[torch.Tensor, float]:
    """Policy-gradient loss over the engine's samples, and their mean reward."""
    gen_logp, advantage, rewards = policy_terms(model, prompts, outs, target)
    loss = -(advantage * gen_logp).sum(1).mean()
    return loss, sum(rewards) / len(rewards)


async def train(args: argparse.Namespace) -> dict[str, Any]:
    task = make_task(args.model, args.prompts, args.seed, args.target_token)
    trainer, prompts, target = task.trainer, task.prompts, task.target
    if args.freeze_embeddings:
        trainer.get_input_embeddings().weight.requires_grad_(False)
        trainer.get_output_embeddings().weight.requires_grad_(False)  # tied: the same tensor here
    config = EngineConfig(backend="transformers", model=task.path, dtype="float32", device="cpu")
    if args.transport == "inproc":
        engine = create_engine(config)
    else:
        from rollout_engines.process import ProcessEngine

        engine = ProcessEngine(config)
    optimizer = torch.optim.Adam([p for p in trainer.parameters() if p.requires_grad], lr=args.lr)
    sync = await connect_weight_sync([engine], args.transport, delta=args.delta)
    rewards: list[float] = []
    sent: list[int] = []  # bytes each push put in its buckets
    full = 0  # bytes of a full push of the state
    start = time.perf_counter()
    try:
        for step in range(args.steps):
            request = GenerateRequest(
                prompt_token_ids=prompts,
                sampling=SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.samples,
                                        ignore_eos=True, seed=args.seed * 100_003 + step),
            )
            outs = await engine.generate(request)
            loss, reward = reinforce_loss(trainer, prompts, outs, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if not args.no_push:
                await sync.push(trainer.state_dict(), version=step + 1)
                sent.append(sync.last_push_bytes)
                full = sync.last_push_model_bytes
            rewards.append(reward)
            if not args.json:
                print(f"step {step:3d}  reward {reward:.3f}  engine v{outs[0].weight_version}", flush=True)
    finally:
        await sync.close()
        await engine.close()
    k = min(3, len(rewards))
    later = sent[1:] or sent  # the first push is always full (a delta needs a base)
    per_step = sum(later) / len(later) if later else 0
    return {
        "transport": args.transport, "pushed": not args.no_push, "target_token": target, "steps": args.steps,
        "delta": args.delta, "freeze_embeddings": args.freeze_embeddings,
        "bytes_per_step": round(per_step), "full_bytes_per_step": full,
        "bytes_ratio": round(per_step / full, 4) if full else None, "bytes_sent": sent,
        "first_reward": sum(rewards[:k]) / k, "last_reward": sum(rewards[-k:]) / k,
        "rewards": [round(r, 4) for r in rewards], "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_example(train, parse_args(argv), lambda s: (
        f"reward {s['first_reward']:.3f} -> {s['last_reward']:.3f} in {s['seconds']} s"))


if __name__ == "__main__":
    main()
