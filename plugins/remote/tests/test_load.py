"""Load: 500 concurrent generate requests against one server all succeed, none lost or mixed up."""

from __future__ import annotations

import asyncio

import pytest
import rollout_engines as roe

pytestmark = pytest.mark.remote

N = 500


async def test_500_concurrent_generates_all_answered_once(served, remote_options):
    engine = roe.create_engine("remote", model=served.url, **remote_options)
    try:
        sampling = roe.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        # Every request has its own prompt, so an answer delivered to the wrong caller shows.
        prompts = [[10 + i % 3000, 7 + i // 3000, 3] for i in range(N)]
        requests = [roe.GenerateRequest(prompt_token_ids=[p], sampling=sampling) for p in prompts]
        results = await asyncio.gather(*(engine.generate(r) for r in requests), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"{len(errors)} of {N} failed, first: {errors[0]!r}"
        assert len(results) == N
        for prompt, outs in zip(prompts, results, strict=True):
            assert len(outs) == 1
            assert outs[0].prompt_token_ids == prompt
            assert len(outs[0].token_ids) == 3
        # The server counted exactly N answered generate calls more than before.
        metrics = (await engine.api.request("GET", "/metrics", raw=True)).text
        line = next(x for x in metrics.splitlines()
                    if x.startswith('rollout_requests_total{endpoint="/generate",status="200"}'))
        assert float(line.rsplit(" ", 1)[1]) >= N
    finally:
        await engine.close()
