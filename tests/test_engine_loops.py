"""One engine, callers on several event loops (a loop per test, a blocking wrapper's own loop):
what holds a request while the engine is paused belongs to no loop."""

from __future__ import annotations

import asyncio

from recording_engine import RecordingEngine
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams


def test_a_pause_holds_and_releases_requests_on_every_loop() -> None:
    engine = RecordingEngine(EngineConfig(backend="recording", model="rec"))
    request = GenerateRequest(prompt_token_ids=[[3]], sampling=SamplingParams(max_tokens=2))

    async def held_then_released() -> list[int]:
        await engine.pause("wait")
        task = asyncio.ensure_future(engine.generate(request))
        await asyncio.sleep(0.05)
        assert not task.done()  # held by the pause
        await engine.resume()
        return (await asyncio.wait_for(task, 10))[0].token_ids

    first = asyncio.run(held_then_released())
    assert asyncio.run(held_then_released()) == first  # a second loop: held and released alike
    asyncio.run(engine.close())
