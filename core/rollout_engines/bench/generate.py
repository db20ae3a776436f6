"""`rollout-engines bench generate --backend NAME --json`: generation throughput through this
library against the same batch run directly on the backend's own API, in one run.

A backend provides the direct side by defining ``generate_benchmark(args) -> dict`` on its engine
class (vLLM: raw ``AsyncLLM``; remote: the same backend in-process). Without it, the engine's own
throughput is reported and ``ratio`` is null.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from ..types import GenerateRequest, SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="transformers")
    parser.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; the best of each side counts")
    parser.add_argument("--served-backend", default="transformers", help="for --backend remote: what the server runs")
    parser.add_argument("--option", action="append", default=[], metavar="K=V", help="backend option (repeatable)")


def batch(args: argparse.Namespace, vocab: int = 4000) -> GenerateRequest:
    """The benchmark batch: fixed pseudo-random token prompts, greedy, ignore_eos (fixed length)."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    return GenerateRequest(prompt_token_ids=prompts, sampling=sampling)


def options(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.option:
        key, _, value = item.partition("=")
        out[key] = value
    return out


async def engine_tokens_per_s(engine: Any, request: GenerateRequest) -> tuple[float, int]:
    start = time.perf_counter()
    outs = await engine.generate(request)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in outs)
    return tokens / seconds, tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ..factory import create_engine
    from ..plugins import get_registry

    if args.model is None:
        from ..testing.tiny_model import tiny_model_path

        args.model = str(tiny_model_path())
    cls = get_registry().load_backend(args.backend)
    hook = getattr(cls, "generate_benchmark", None)
    if hook is not None:
        return dict(hook(args))

    async def go() -> dict[str, Any]:
        engine = await asyncio.to_thread(create_engine, args.backend, args.model, **options(args))
        try:
            request = batch(args)
            await engine.generate(request)  # warm-up
            best, tokens = 0.0, 0
            for _ in range(args.repeats):
                tps, tokens = await engine_tokens_per_s(engine, request)
                best = max(best, tps)
        finally:
            await engine.close()
        return {
            "backend": args.backend, "prompts": args.prompts, "max_tokens": args.max_tokens,
            "tokens": tokens, "tokens_per_s": round(best, 1), "direct_tokens_per_s": None, "ratio": None,
        }

    return asyncio.run(go())
