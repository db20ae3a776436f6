"""The main job, end to end on one engine: generate, push new weights, see outputs change, sleep,
wake, and report. `rollout-engines demo` runs it; it is also the shortest tour of the API."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .engine import EngineProtocol
from .types import GenerateRequest, SamplingParams

logger = logging.getLogger("rollout_engines.demo")

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import numpy as np",
    "Once upon a time",
    "class Engine:",
    "for i in range(10):",
    "Reinforcement learning is",
    "return self.",
]


def demo_request(max_tokens: int = 32) -> GenerateRequest:
    return GenerateRequest(prompts=PROMPTS, sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1))


PREFERRED_TRANSPORTS = ("inproc", "shm", "cuda_ipc", "gloo", "nccl", "http", "disk")


def pick_transport(engine: EngineProtocol) -> str:
    """The cheapest transport the engine declares (in-process first, disk last)."""
    declared = engine.capabilities.transports
    for name in PREFERRED_TRANSPORTS:
        if name in declared:
            return name
    if declared:
        return declared[0]
    raise ValueError(f"backend '{engine.backend_name}' declares no weight transport")


async def run_demo(engine: EngineProtocol, *, transport: str | None = None, max_tokens: int = 32, say: Any = None) -> dict[str, Any]:
    """Run the demo on a started engine; returns the summary (see ``rollout-engines demo --json``).
    ``transport`` None picks the cheapest one the engine declares."""
    from .weights.checkpoint import load_checkpoint, perturbed
    from .weights.session import connect_weight_sync

    say = say or (lambda *a: None)
    transport = transport or pick_transport(engine)
    request = demo_request(max_tokens)
    start = time.perf_counter()
    before = await engine.generate(request)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in before)
    say(f"generated {tokens} tokens for {len(before)} prompts in {seconds:.2f} s (weights v{engine.weight_version})")

    original = load_checkpoint(engine.config.model)
    sync = await connect_weight_sync([engine], transport)
    try:
        push_start = time.perf_counter()
        version = await sync.push(perturbed(original), version=engine.weight_version + 1)
        push_seconds = time.perf_counter() - push_start
        after = await engine.generate(request)
        changed = [a.token_ids != b.token_ids for a, b in zip(after, before, strict=True)]
        say(f"pushed v{version} over {transport} in {push_seconds * 1e3:.0f} ms: {sum(changed)}/{len(changed)} outputs changed")
        slept = False
        if engine.capabilities.supports_sleep():
            await engine.sleep(level=min(engine.capabilities.sleep_levels))
            await engine.wake_up()
            again = await engine.generate(request)
            slept = True
            same = all(a.token_ids == b.token_ids for a, b in zip(again, after, strict=True))
            say(f"slept and woke: outputs {'unchanged' if same else 'CHANGED'} after wake-up")
        else:
            same = True
            say(f"sleep is not supported by '{engine.backend_name}' here; skipped")
        restored_version = await sync.push(original, version=version + 1)
        restored = await engine.generate(request)
        back = all(a.token_ids == b.token_ids for a, b in zip(restored, before, strict=True))
        say(f"pushed the original weights as v{restored_version}: outputs {'back to the first' if back else 'DIFFERENT'}")
    finally:
        await sync.close()
    return {
        "backend": engine.backend_name,
        "model": engine.config.model,
        "transport": transport,
        "prompts": len(before),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "push_seconds": round(push_seconds, 4),
        "outputs_changed": any(changed),
        "changed_fraction": sum(changed) / len(changed),
        "versions_tagged": all(c.weight_version == version for c in after),
        "slept": slept,
        "same_after_wake": same,
        "restored_outputs_equal": back,
        "weight_version": version,
        "final_weight_version": engine.weight_version,
    }


def main_demo(backend: str, model: str | None, transport: str | None, max_tokens: int, say: Any) -> dict[str, Any]:
    from .factory import create_engine

    if model is None:
        from .testing.tiny_model import tiny_model_path

        say("building / loading the tiny test model ...")
        model = str(tiny_model_path())

    async def go() -> dict[str, Any]:
        engine = await asyncio.to_thread(create_engine, backend, model)
        try:
            return await run_demo(engine, transport=transport, max_tokens=max_tokens, say=say)
        finally:
            await engine.close()

    return asyncio.run(go())
