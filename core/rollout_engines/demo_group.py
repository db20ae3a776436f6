"""The main job on an :class:`EngineGroup` of N engines (local, or Ray actors with ``use_ray``):
`rollout-engines demo --engines N [--ray]`.

It runs the single-engine demo (:func:`rollout_engines.demo.run_demo`) with the group as the
engine (one weight-sync session reaches every engine), then measures rollout throughput with the
prompts sent as separate requests, so the router spreads them over the engines.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from .engine import EngineProtocol
from .types import GenerateRequest, SamplingParams

logger = logging.getLogger("rollout_engines.demo")


async def measure_throughput(
    engine: EngineProtocol, prompts: list[str], *, rounds: int = 4, max_tokens: int = 32, concurrency: int | None = None
) -> tuple[float, int, float]:
    """Send every prompt ``rounds`` times as its own greedy request (``concurrency`` at a time;
    default all at once); returns (generated tokens per second, tokens, seconds)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [GenerateRequest(prompts=[p], sampling=sampling) for _ in range(rounds) for p in prompts]
    limit = asyncio.Semaphore(concurrency or len(requests))

    async def one(request: GenerateRequest) -> int:
        async with limit:
            return sum(len(c.token_ids) for c in await engine.generate(request))

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(r) for r in requests)))
    seconds = time.perf_counter() - start
    return tokens / seconds, tokens, seconds


async def start_engines(
    backend: str, model: str, n: int, *, use_ray: bool, ray_cpus_per_engine: float = 1.0, **engine_kwargs: Any
) -> list[EngineProtocol]:
    """Start ``n`` engines in this process, or as Ray actors (concurrently; Ray started if needed)."""
    if use_ray:
        import ray

        from .ray import acreate_ray_engines

        if not ray.is_initialized():
            ray.init(num_cpus=max(math.ceil(n * ray_cpus_per_engine), 1), include_dashboard=False, log_to_driver=False)
        return list(await acreate_ray_engines(n, backend, model, num_cpus=ray_cpus_per_engine, **engine_kwargs))
    from .factory import acreate_engine

    # One at a time: loading transformers models from several threads at once is not safe.
    started: list[EngineProtocol] = []
    try:
        for _ in range(n):
            started.append(await acreate_engine(backend, model, **engine_kwargs))
    except BaseException:
        await asyncio.gather(*(e.close() for e in started), return_exceptions=True)
        raise
    return started


def run_group_demo(
    backend: str, model: str | None, engines: int, use_ray: bool, *, say: Callable[..., Any] | None = None,
    max_tokens: int = 32,
) -> dict[str, Any]:
    """Run the demo on a group of ``engines`` engines; returns the summary (``demo --json``):
    the single-engine demo's keys plus ``engines``, ``ray`` and ``per_engine``; ``tokens_per_s`` is the
    group's throughput (one request per prompt), ``single_request_tokens_per_s`` the demo's one batch."""
    from .demo import PROMPTS, run_demo
    from .group import EngineGroup

    say = say or (lambda *a: None)
    if engines < 1:
        raise ValueError("--engines must be >= 1")
    if model is None:
        from .testing.tiny_model import tiny_model_path

        say("building / loading the tiny test model ...")
        model = str(tiny_model_path())
    started_ray = False
    if use_ray:
        import ray

        started_ray = not ray.is_initialized()

    async def go() -> dict[str, Any]:
        members = await start_engines(backend, model, engines, use_ray=use_ray)
        say(f"started {engines} '{backend}' engine(s){' as Ray actors' if use_ray else ''}")
        group = EngineGroup(members, routing="least_outstanding")
        try:
            transport = "gloo" if use_ray else "inproc"
            summary = await run_demo(group, transport=transport, max_tokens=max_tokens, say=say)
            tps, tokens, seconds = await measure_throughput(group, PROMPTS, rounds=2 * engines, max_tokens=max_tokens)
            say(f"group throughput: {tokens} tokens in {seconds:.2f} s = {tps:.0f} tokens/s over {engines} engine(s)")
            summary.update(
                backend=backend,
                engines=engines,
                ray=use_ray,
                tokens_per_s=round(tps, 1),
                single_request_tokens_per_s=summary["tokens_per_s"],
                per_engine=[{k: s[k] for k in ("completed", "weight_version", "serving")} for s in group.member_stats()],
            )
            return summary
        finally:
            await group.close()

    try:
        return asyncio.run(go())
    finally:
        if started_ray:
            import ray

            ray.shutdown()
