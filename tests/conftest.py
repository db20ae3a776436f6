"""Fixtures the core suite shares: the embedded transformers engine on the tiny model, a wait for
what an engine's worker makes true, and the check that one push reaches every engine of a group."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

PATIENCE_S = 30.0  # for waits on a busy machine


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[Any]:
    """The embedded transformers engine on the tiny model (float32), closed after the test."""
    from rollout_engines import create_engine
    from rollout_engines.backends.transformers.engine import TransformersEngine

    e = create_engine("transformers", model=str(tiny_model), dtype="float32")
    assert isinstance(e, TransformersEngine)
    yield e
    asyncio.run(e.close())


async def _wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.002)


@pytest.fixture
def wait_until() -> Callable[[Callable[[], bool], str], Awaitable[None]]:
    """``await wait_until(check, what)``: poll ``check`` every 2 ms until it holds; fail after
    ``PATIENCE_S`` seconds, saying what did not happen."""
    return _wait_until


@pytest.fixture
def one_push_reaches_both(tiny_model: Path) -> Callable[..., Awaitable[None]]:
    """``await one_push_reaches_both(group, engines, seed=, version=, routed=)``: the group's two
    engines answer alike; one gloo push to the group changes both, to the same weights; then
    ``routed`` requests through the group get those weights' tokens, tagged with ``version``."""
    from rollout_engines import GenerateRequest, SamplingParams, connect_weight_sync
    from rollout_engines.weights.checkpoint import load_checkpoint, perturbed

    request = GenerateRequest(prompts=["The quick brown fox", "def add(a, b):"],
                              sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    async def check(group: Any, engines: list[Any], *, seed: int, version: int, routed: int) -> None:
        before = [[c.token_ids for c in await e.generate(request)] for e in engines]
        assert before[0] == before[1]
        sync = await connect_weight_sync([group], "gloo", timeout_s=120)
        try:
            await sync.push(perturbed(load_checkpoint(tiny_model), seed=seed), version=version)
        finally:
            await sync.close()
        after = [[c.token_ids for c in await e.generate(request)] for e in engines]
        assert after[0] == after[1] != before[0]  # both engines changed, to the same weights
        outs = [await group.generate(request) for _ in range(routed)]
        assert all([c.token_ids for c in r] == after[0] and r[0].weight_version == version for r in outs)

    return check
