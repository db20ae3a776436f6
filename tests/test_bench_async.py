"""`rollout-engines bench async` through the real command line, on the transformers backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(300)]


def test_bench_async_cli(tiny_model):
    cmd = [sys.executable, "-m", "rollout_engines", "bench", "async", "--backend", "transformers",
           "--model", str(tiny_model), "--requests", "24", "--concurrency", "4", "--step-requests", "6",
           "--max-tokens", "12", "--aborts", "6", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "transformers" and result["transport"] == "inproc"
    assert result["tokens_per_s_no_push"] > 0 and result["tokens_per_s_push"] > 0
    assert result["pushes"] >= 2
    assert result["idle_source"] == "engine info()"
    assert 0.0 <= result["idle_fraction"] <= 1.0 and 0.0 <= result["idle_fraction_no_push"] <= 1.0
    assert result["aborts"] == 6
    assert 0 < result["abort_ms_median"] <= result["abort_ms_p99"] < 5000


async def test_a_pause_between_two_samples_counts_as_idle(tiny_model):
    """bench async's engine-side idle measure: a keep pause (with a push, here a blocking stall)
    can begin and end between two samples of ``info()``; the engine's own count of paused
    seconds (``info().paused_s``) still puts it in the idle time. Sampling the state alone saw the
    engine running again and counted nothing."""
    import asyncio
    import time

    from rollout_engines import GenerateRequest, SamplingParams, create_engine
    from rollout_engines.bench.async_ import EngineSampler

    engine = create_engine("transformers", model=str(tiny_model))
    try:
        long = asyncio.ensure_future(engine.generate(GenerateRequest(
            prompt_token_ids=[[5, 6, 7]], sampling=SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True))))
        await asyncio.sleep(0.3)  # running
        before = (await engine.info()).paused_s
        sampler = EngineSampler(engine, lambda: 1, interval_s=0.5)
        sampling = asyncio.ensure_future(sampler.run())
        await asyncio.sleep(0.05)  # the first sample is taken
        await engine.pause("keep")
        time.sleep(0.3)  # the event loop is held: no sample during the pause
        await engine.resume()
        assert (await engine.info()).paused_s - before >= 0.3
        await asyncio.sleep(0.05)
        sampler.stop()
        await sampling
        assert sampler.idle_s >= 0.29, sampler.idle_s
        assert sampler.idle_s <= sampler.wall_s
        await engine.abort_all()
        await long
    finally:
        await engine.close()
