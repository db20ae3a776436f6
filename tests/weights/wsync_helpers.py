"""Shared pieces of the cross-process weight-sync tests (importable by spawned children)."""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import module_engine
import torch
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams
from rollout_engines.process import ProcessEngine
from rollout_engines.testing.trainer import stalling_trainer

PROMPTS = GenerateRequest(prompt_token_ids=[[1], [2], [3], [5]], sampling=SamplingParams(temperature=0, max_tokens=6))
#: Small buckets, so every update has several of them (the bigram model is ~12 KB).
BUCKET = 4096


def module_engine_process(mode: str = "staged") -> ProcessEngine:
    return ProcessEngine(
        EngineConfig(backend="module", model="bigram", options={"mode": mode}), factory="module_engine:ModuleEngine"
    )


async def outputs(engine: Any, request: GenerateRequest = PROMPTS) -> list[list[int]]:
    return [c.token_ids for c in await engine.generate(request)]


def state(seed: int) -> dict[str, torch.Tensor]:
    return dict(module_engine.make_model(seed).state_dict())


def trainer_main(conn: Connection, transport: str, world_size: int, timeout_s: float, options: dict[str, Any],
                 seed: int, stall_after: int) -> None:
    """A trainer in its own process: host the sender, stream one update, stall after
    ``stall_after`` tensors (announcing it) so the test can kill this process mid-stream."""
    stalling_trainer(conn, transport, lambda: state(seed), stall_after, session_id="killed-trainer",
                     world_size=world_size, timeout_s=timeout_s, bucket_bytes=BUCKET, options=options)


def tiny_state(path: str, noise: float = 0.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny model's state dict as a trainer holds it, optionally perturbed."""
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).state_dict()
    if noise:
        gen = torch.Generator().manual_seed(seed)
        sd = {k: v + noise * torch.randn(v.shape, generator=gen) for k, v in sd.items()}
    return {k: v.contiguous() for k, v in sd.items()}


def tiny_trainer_main(conn: Connection, transport: str, world_size: int, timeout_s: float, path: str,
                      stall_after: int) -> None:
    """:func:`trainer_main` for the tiny transformers model."""
    stalling_trainer(conn, transport, lambda: tiny_state(path, noise=1.0), stall_after,
                     session_id="killed-tiny-trainer", world_size=world_size, timeout_s=timeout_s, bucket_bytes=2**18)


def bench_receiver(tensors: dict[str, torch.Tensor], wrap: Callable[[Any], Any] | None = None) -> Any:
    """An engine with nothing but a weight receiver (the benchmark's) expecting ``tensors``' names,
    dtypes and shapes; ``wrap`` wraps its target (a target that fails, or cannot read back)."""
    from rollout_engines.bench.weight_sync import BenchReceiverEngine
    from rollout_engines.weights.manifest import specs_of

    specs = [s.model_dump() for s in specs_of(list(tensors.items()))]
    engine = BenchReceiverEngine(EngineConfig(backend="bench-receiver", model="-", options={"specs": specs}))
    if wrap is not None:
        engine.receiver.target = engine.receiver._home_target = wrap(engine.target)
    return engine
