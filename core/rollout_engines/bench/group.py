"""`rollout-engines bench group --json`: the router's own cost, and throughput from 1 to 2 engines.

- ``routed_per_s``: requests per second through an :class:`EngineGroup` of engines that answer
  instantly (:class:`InstantEngine`), so only the group's dispatch is measured; ``direct_per_s`` is
  the same loop calling one such engine directly, and ``overhead_us`` the difference per request.
  The ``*_yielding`` variants use engines that yield to the event loop once per request, so the
  requests are truly concurrent (the router sees outstanding counts above zero);
  ``routed_per_s_backpressure`` the same with at most 2 requests in flight per engine, so most
  requests go through the wait queue.
- ``scaling``: rollout tokens/s of a group of 2 real engines divided by that of 1 (same prompts,
  one request per prompt, greedy, fixed length). ``--ray`` runs the engines as Ray actors (one
  process each); otherwise they share this process.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from ..engine import Engine
from ..types import Completion, EngineConfig, GenerateRequest, SamplingParams


class InstantEngine(Engine):
    """Answers every request at once with a fixed completion: measures the caller, not the engine.

    ``yields``: hand control to the event loop once per request, as any engine that waits for I/O
    or a worker does, so requests really are in flight together (costs one loop turn each)."""

    backend_name = "instant"

    def __init__(self, yields: bool = False) -> None:
        super().__init__(EngineConfig(backend="instant", model="instant"))
        self.answer = [Completion(prompt_index=0, token_ids=[1], finish_reason="length", weight_version=0)]
        self.calls = 0
        self.yields = yields

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        self.calls += 1
        if self.yields:
            await asyncio.sleep(0)
        return self.answer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=50_000, help="requests for the router measurement")
    parser.add_argument("--concurrency", type=int, default=64, help="callers sending requests at once")
    parser.add_argument("--routing", default="least_outstanding", choices=["round_robin", "least_outstanding", "sticky"])
    parser.add_argument("--router-engines", type=int, default=4, help="instant engines behind the router")
    parser.add_argument("--backend", default="transformers", help="backend for the scaling measurement")
    parser.add_argument("--model", default=None, help="model path (default: the tiny test model)")
    parser.add_argument("--ray", action="store_true", help="scaling engines as Ray actors")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=32, help="requests per scaling measurement")
    parser.add_argument("--repeats", type=int, default=3, help="scaling runs per engine count (best is kept)")
    parser.add_argument("--skip-scaling", action="store_true", help="only measure the router")


async def _drive(engine: Engine, requests: list[GenerateRequest], concurrency: int) -> float:
    """Send ``requests`` from ``concurrency`` callers; returns requests per second."""
    per = len(requests) // concurrency

    async def caller(chunk: list[GenerateRequest]) -> None:
        generate = engine.generate
        for r in chunk:
            await generate(r)

    chunks = [requests[i * per:(i + 1) * per] for i in range(concurrency)]
    start = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in chunks))
    return per * concurrency / (time.perf_counter() - start)


async def measure_router(
    requests: int, concurrency: int, routing: str, engines: int, *, yields: bool = False, bound: int = 128
) -> dict[str, Any]:
    from ..group import EngineGroup

    sampling = SamplingParams(max_tokens=1)
    batch = [
        GenerateRequest(prompt_token_ids=[[i % 1000 + 1]], sampling=sampling, session_id=f"s{i % 512}")
        for i in range(requests)
    ]
    direct = InstantEngine(yields)
    members = [InstantEngine(yields) for _ in range(engines)]
    group = EngineGroup(members, routing=routing, max_outstanding_per_engine=bound)  # type: ignore[arg-type]
    await _drive(group, batch[: min(2000, requests)], concurrency)  # warm up
    await _drive(direct, batch[: min(2000, requests)], concurrency)
    best_routed = best_direct = 0.0
    for _ in range(3):  # best of three: other processes share the CPU
        best_direct = max(best_direct, await _drive(direct, batch, concurrency))
        best_routed = max(best_routed, await _drive(group, batch, concurrency))
    spread = [m.calls for m in members]
    await group.close()
    return {
        "routed_per_s": round(best_routed),
        "direct_per_s": round(best_direct),
        "overhead_us": round(1e6 / best_routed - 1e6 / best_direct, 2),
        "routing": routing,
        "router_engines": engines,
        "concurrency": concurrency,
        "requests": requests,
        "spread": spread,
    }


async def measure_scaling(args: argparse.Namespace) -> dict[str, Any]:
    from ..demo import PROMPTS
    from ..demo_group import measure_throughput, start_engines
    from ..group import EngineGroup

    model = args.model
    if model is None:
        from ..testing.tiny_model import tiny_model_path

        model = str(tiny_model_path())
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    engines = await start_engines(args.backend, model, 2, use_ray=args.ray)
    result: dict[str, Any] = {"backend": args.backend, "ray": args.ray, "max_tokens": args.max_tokens}
    try:
        groups = {count: EngineGroup(engines[:count], health_interval_s=None) for count in (1, 2)}
        best = {1: 0.0, 2: 0.0}
        # Warm up every batch shape first (the first batches are many times slower), then
        # alternate 1 and 2 engines so load from other processes hits both alike.
        for round_ in range(args.repeats + 1):
            for count, group in groups.items():
                tps, _, _ = await measure_throughput(group, prompts, rounds=1, max_tokens=args.max_tokens)
                if round_ > 0:
                    best[count] = max(best[count], tps)
        for count in (1, 2):
            result[f"tokens_per_s_{count}"] = round(best[count], 1)
    finally:
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
    result["scaling"] = round(result["tokens_per_s_2"] / result["tokens_per_s_1"], 3)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    started_ray = False
    if getattr(args, "ray", False) and not args.skip_scaling:
        import ray

        started_ray = not ray.is_initialized()

    async def go() -> dict[str, Any]:
        out = await measure_router(args.requests, args.concurrency, args.routing, args.router_engines)
        yielding = await measure_router(args.requests, args.concurrency, args.routing, args.router_engines, yields=True)
        out["routed_per_s_yielding"] = yielding["routed_per_s"]
        out["direct_per_s_yielding"] = yielding["direct_per_s"]
        out["overhead_us_yielding"] = yielding["overhead_us"]
        # at most 2 in flight per engine: with more callers than that, most requests wait in the queue
        queued = await measure_router(args.requests, args.concurrency, args.routing, args.router_engines, yields=True, bound=2)
        out["routed_per_s_backpressure"] = queued["routed_per_s"]
        out["target_routed_per_s"] = 20_000
        if not args.skip_scaling:
            out.update(await measure_scaling(args))
        return out

    try:
        return asyncio.run(go())
    finally:
        if started_ray:
            import ray

            ray.shutdown()
