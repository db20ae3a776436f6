"""`rollout-engines bench generate --backend NAME --json`: generation throughput through this
library against the same batch run directly on the backend's own API, in one run.

A backend provides the direct side by registering a ``generate_baseline`` with its
:class:`~rollout_engines.plugins.BackendEntry` (``"package.module:function"``, a function of
:class:`GenerateArgs` returning the result dict; transformers: ``model.generate`` on the same
model object; vLLM: raw ``AsyncLLM``; remote: the same backend in-process). Without one, the
engine's own throughput is reported and ``ratio`` is null.

What a baseline may use from here (the benchmark API for plugins): :class:`GenerateArgs` (its
:meth:`~GenerateArgs.batch` is the standard batch) and :func:`engine_tokens_per_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..options import add_option_argument
from ..types import GenerateRequest, SamplingParams
from .common import parse_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="transformers")
    parser.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; the best of each side counts")
    parser.add_argument("--served-backend", default="transformers", help="for --backend remote: what the server runs")
    add_option_argument(parser)


class GenerateArgs(BaseModel):
    """The arguments of ``bench generate``, for this library's side and a backend's baseline alike."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    backend: str = "transformers"
    model: str | None = Field(default=None, description="Model directory; None: the tiny test model.")
    prompts: int = Field(default=64, ge=1, description="Batch size.")
    prompt_len: int = Field(default=32, ge=1)
    max_tokens: int = Field(default=64, ge=1)
    repeats: int = Field(default=3, ge=1, description="Rounds; the best of each side counts.")
    served_backend: str = Field(default="transformers", description="For the remote backend: what the server runs.")
    options: dict[str, Any] = Field(default_factory=dict, description="Engine options.")

    @classmethod
    def of(cls, args: GenerateArgs | argparse.Namespace | Mapping[str, Any]) -> GenerateArgs:
        """From the CLI's namespace or a dict (``option``: ``K=V`` strings, merged into ``options``)."""
        if isinstance(args, GenerateArgs):
            return args
        raw = dict(args) if isinstance(args, Mapping) else dict(vars(args))
        fields = {k: v for k, v in raw.items() if v is not None and k in cls.model_fields}
        fields["options"] = parse_options(raw)
        return cls.model_validate(fields)

    def model_path(self) -> str:
        """:attr:`model`, or the tiny test model's directory."""
        if self.model is not None:
            return self.model
        from ..testing.tiny_model import tiny_model_path

        return str(tiny_model_path())

    def batch(self, vocab: int = 4000) -> GenerateRequest:
        """The benchmark batch: fixed pseudo-random token prompts, greedy, ignore_eos (fixed length)."""
        import random

        rng = random.Random(0)
        prompts = [[rng.randrange(10, vocab) for _ in range(self.prompt_len)] for _ in range(self.prompts)]
        sampling = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
        return GenerateRequest(prompt_token_ids=prompts, sampling=sampling)


async def engine_tokens_per_s(engine: Any, request: GenerateRequest) -> tuple[float, int]:
    """One ``engine.generate(request)``: tokens per second and tokens made."""
    start = time.perf_counter()
    outs = await engine.generate(request)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in outs)
    return tokens / seconds, tokens


def run(args: GenerateArgs | argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
    from ..factory import create_engine
    from ..plugins import get_registry

    bench = GenerateArgs.of(args)
    bench = bench.model_copy(update={"model": bench.model_path()})
    baseline = get_registry().backend(bench.backend).load_generate_baseline()
    if baseline is not None:
        return dict(baseline(bench))

    async def go() -> dict[str, Any]:
        engine = await asyncio.to_thread(create_engine, bench.backend, bench.model_path(), **bench.options)
        try:
            request = bench.batch()
            await engine.generate(request)  # warm-up
            best, tokens = 0.0, 0
            for _ in range(bench.repeats):
                tps, tokens = await engine_tokens_per_s(engine, request)
                best = max(best, tps)
        finally:
            await engine.close()
        return {
            "backend": bench.backend, "prompts": bench.prompts, "max_tokens": bench.max_tokens,
            "tokens": tokens, "tokens_per_s": round(best, 1), "direct_tokens_per_s": None, "ratio": None,
        }

    return asyncio.run(go())
