"""Asynchronous RL: generation never stops while the trainer learns (one-step off-policy).

    python examples/async_rl.py --json
    python examples/async_rl.py --no-push --json        # control: the engine never learns

The task and reward are those of ``toy_rl.py``: the reward of a completion is the fraction of its
tokens equal to a target token (the untrained model's favourite, still rare). Unlike ``toy_rl.py``
nothing waits for anything:

- a **producer** keeps ``--in-flight`` requests running in the engine all the time (each one
  prompt, streamed with ``stream``); every finished rollout goes into a queue of at most
  ``--batch`` rollouts (a full queue holds the producer back, which bounds how stale rollouts get);
- the **trainer** takes ``--batch`` finished rollouts, takes one policy-gradient step (in a thread,
  so the event loop keeps feeding the engine) and pushes the new weights after every step inside
  ``pause(mode="keep")`` / ``resume()``: rollouts running at that moment freeze, get the new weights
  and carry on, so their first tokens come from one version and the rest from the next;
- the **correction** uses the per-token weight versions (``delta.weight_version`` of each streamed
  token, ``Completion.versions()`` for non-streamed ones): for each token, ``lag`` = trainer
  version - the version that sampled it. A token with ``lag == 0`` was sampled by exactly the
  trainer's current weights (weight 1); a token with ``0 < lag <= --max-lag`` gets the truncated
  importance weight ``min(exp(logp_trainer - logp_engine), --is-cap)`` (the engine returned its
  ``logp`` of each token: the behaviour policy); a token with ``lag > --max-lag`` is dropped.

The JSON reports ``reward_first`` / ``reward_last`` (mean of the first / last three steps),
``pushes``, ``completions_spanning_updates`` (consumed rollouts with tokens of two or more versions),
the correction's statistics, and ``idle_fraction``: the fraction of wall time the engine stepped no
request while requests were waiting, sampled from ``engine.info()`` (it is frozen during each
push, and recomputes the kept rows' KV after it); ``stall_fraction`` is the same seen from the
deltas' time stamps (any gap beyond one decode step, prefills included).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams, connect_weight_sync, create_engine
from rollout_engines.bench.async_ import EngineSampler, IdleMeter

if str(Path(__file__).resolve().parent) not in sys.path:  # the task module beside this file, also when a
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # test loads this file by its path
from toy_task import make_task, policy_terms, run_example  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=48, help="rollouts per trainer step")
    p.add_argument("--in-flight", type=int, default=32, help="requests the producer keeps running")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--max-lag", type=int, default=2, help="drop tokens sampled more than this many versions ago")
    p.add_argument("--is-cap", type=float, default=2.0, help="truncation of the per-token importance weight")
    p.add_argument("--target-token", type=int, default=None, help="default: the model's most likely token at start")
    p.add_argument("--no-push", action="store_true", help="train but never push (the control run)")
    p.add_argument("--trainer-threads", type=int, default=1, help="torch threads of the trainer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON summary last")
    return p.parse_args(argv)


@dataclass
class Rollout:
    prompt_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the engine's (behaviour policy's)
    versions: list[int] = field(default_factory=list)  # weight version of each token

    @property
    def spans_update(self) -> bool:
        return len(set(self.versions)) > 1


def policy_loss(model: Any, prompts: list[list[int]], batch: list[Rollout], target: int, version: int,
                max_lag: int, is_cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with reward-to-go and a per-position batch-mean baseline (as toy_rl), each token
    weighted by its truncated importance weight, chosen by its version lag."""
    logp_now, advantage, rewards = policy_terms(model, prompts, batch, target)
    # Per-token correction from the per-token versions.
    lag = version - torch.tensor([r.versions for r in batch])
    logp_engine = torch.tensor([r.logprobs for r in batch])
    ratio = torch.exp(logp_now.detach() - logp_engine).clamp(max=is_cap)
    weight = torch.where(lag == 0, torch.ones_like(ratio), ratio)
    weight = torch.where(lag > max_lag, torch.zeros_like(weight), weight)
    loss = -(weight * advantage * logp_now).sum(1).mean()
    lagged = (lag > 0) & (lag <= max_lag)
    stats = {
        "reward": sum(rewards) / len(rewards),
        "lagged_tokens": int(lagged.sum()), "dropped_tokens": int((lag > max_lag).sum()),
        "tokens": int(lag.numel()), "max_lag": int(lag.max()),
        "is_weight_sum": float(weight[lagged].sum()),
        "truncated": int(((logp_now.detach() - logp_engine).exp() > is_cap)[lagged].sum()),
    }
    return loss, stats


async def train(args: argparse.Namespace) -> dict[str, Any]:
    task = make_task(args.model, args.prompts, args.seed, args.target_token)
    trainer, prompts, target = task.trainer, task.prompts, task.target
    engine = create_engine(EngineConfig(backend="transformers", model=task.path, dtype="float32", device="cpu"))
    optimizer = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    sync = await connect_weight_sync([engine], "inproc")

    queue: asyncio.Queue[Rollout] = asyncio.Queue(maxsize=args.batch)
    meter = IdleMeter()  # the deltas' view
    sampler = EngineSampler(engine, lambda: meter.inflight)  # the engine's view
    slots = asyncio.Semaphore(args.in_flight)
    produced = 0

    async def rollout(k: int) -> None:
        """One request, streamed: its tokens, the engine's logprobs and each token's version."""
        r = Rollout(prompt_index=k % len(prompts))
        request = GenerateRequest(
            prompt_token_ids=[prompts[r.prompt_index]], request_ids=[f"rollout-{k}"],
            sampling=SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1,
                                    seed=args.seed * 1_000_003 + k),
        )
        meter.begin(k)
        try:
            async for delta in engine.stream(request):
                meter.tokens(k, len(delta.token_ids))
                r.token_ids += delta.token_ids
                r.logprobs += delta.logprobs or []
                # A delta holds the tokens of one step, so one version (a consumer that fell
                # behind across a push would get the older tokens labelled new: stricter lag).
                r.versions += [delta.weight_version] * len(delta.token_ids)
        finally:
            meter.end(k)
        await queue.put(r)  # a full queue holds this slot: the producer slows down

    async def producer() -> None:
        nonlocal produced
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                await slots.acquire()
                task = asyncio.ensure_future(rollout(produced))
                produced += 1
                running.add(task)
                task.add_done_callback(lambda t: (running.discard(t), slots.release()))
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    def step(batch: list[Rollout], version: int) -> dict[str, float]:
        torch.set_num_threads(args.trainer_threads)
        loss, stats = policy_loss(trainer, prompts, batch, target, version, args.max_lag, args.is_cap)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return stats

    history: list[dict[str, Any]] = []
    pushes, spanning, pause_s = 0, 0, 0.0
    start = time.perf_counter()
    producing = asyncio.ensure_future(producer())
    sampling = asyncio.ensure_future(sampler.run())
    try:
        for version in range(args.steps):  # the trainer's weights are `version` optimizer steps old
            batch = [await queue.get() for _ in range(args.batch)]
            spanning += sum(r.spans_update for r in batch)
            stats = await asyncio.to_thread(step, batch, version)
            if not args.no_push:
                t0 = time.perf_counter()
                await engine.pause(mode="keep")  # running rollouts freeze where they are
                try:
                    await sync.push(trainer.state_dict(), version=version + 1)
                finally:
                    await engine.resume()  # ... and continue under the new weights
                pause_s += time.perf_counter() - t0
                pushes += 1
            history.append({**stats, "spanning": sum(r.spans_update for r in batch)})
            if not args.json:
                print(f"step {version:3d}  reward {stats['reward']:.3f}  lagged tokens {stats['lagged_tokens']:4d}  "
                      f"spanning {history[-1]['spanning']:3d}  engine v{engine.weight_version}", flush=True)
    finally:
        seconds = time.perf_counter() - start
        sampler.stop()
        producing.cancel()
        await asyncio.gather(producing, sampling, return_exceptions=True)
        await sync.close()
        await engine.close()
    rewards = [h["reward"] for h in history]
    k = min(3, len(rewards))
    lagged = sum(h["lagged_tokens"] for h in history)
    engine_idle = sampler.result()
    return {
        "pushed": not args.no_push, "target_token": target, "steps": args.steps, "batch": args.batch,
        "in_flight": args.in_flight,
        "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
        "rewards": [round(r, 4) for r in rewards],
        "pushes": pushes, "completions_spanning_updates": spanning, "rollouts_consumed": len(history) * args.batch,
        "rollouts_started": produced,
        "lagged_token_fraction": round(lagged / max(1, sum(h["tokens"] for h in history)), 4),
        "is_weight_mean": round(sum(h["is_weight_sum"] for h in history) / lagged, 4) if lagged else None,
        "is_truncated_tokens": sum(h["truncated"] for h in history),
        "dropped_tokens": sum(h["dropped_tokens"] for h in history),
        "max_lag": max((h["max_lag"] for h in history), default=0),
        "idle_fraction": engine_idle if engine_idle is not None else meter.result()["idle_fraction"],
        "stall_fraction": meter.result()["idle_fraction"],
        "pause_push_s": round(pause_s, 3),
        "tokens_per_s": round(meter.token_count / seconds, 1) if seconds > 0 else None,
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_example(train, parse_args(argv), lambda s: (
        f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} in {s['seconds']} s; "
        f"{s['completions_spanning_updates']} rollouts spanned a push; engine idle {s['idle_fraction']}"))


if __name__ == "__main__":
    main()
