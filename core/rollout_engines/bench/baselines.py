"""Direct baselines of the core's own backends for ``rollout-engines bench generate`` (registered as
:attr:`~rollout_engines.plugins.BackendEntry.generate_baseline`; plugins register theirs).

``transformers``: the engine against transformers' own ``model.generate`` on the same model object
and the same batch, in one run. Rounds alternate so load from other processes hits both sides
alike; the best round of each counts. Both sides run on a worker thread with the engine's
intra-op thread count.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

from .generate import GenerateArgs, engine_tokens_per_s


def transformers_generate(args: GenerateArgs) -> dict[str, Any]:
    import torch

    from ..backends.transformers.engine import TransformersEngine
    from ..factory import create_engine

    request = args.batch()

    async def run() -> tuple[float, float, int]:
        engine = await asyncio.to_thread(create_engine, "transformers", args.model_path(), **args.options)
        assert isinstance(engine, TransformersEngine)
        ids = torch.tensor(request.prompt_token_ids, device=engine.device)

        def init() -> None:
            if engine.num_threads and engine.device.type == "cpu":
                torch.set_num_threads(engine.num_threads)

        pool = concurrent.futures.ThreadPoolExecutor(1, initializer=init)

        def direct() -> tuple[float, int]:
            start = time.perf_counter()
            with torch.inference_mode():
                out = engine.hf_model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.max_tokens,
                    min_new_tokens=args.max_tokens, pad_token_id=engine.pad_id,
                )
            tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
            return tokens / (time.perf_counter() - start), tokens

        loop = asyncio.get_running_loop()
        try:
            await engine.generate(request)  # warm-up both
            await loop.run_in_executor(pool, direct)
            best_engine = best_direct = 0.0
            tokens = 0
            for _ in range(args.repeats):
                tps, tokens = await engine_tokens_per_s(engine, request)
                best_engine = max(best_engine, tps)
                tps, _ = await loop.run_in_executor(pool, direct)
                best_direct = max(best_direct, tps)
            return best_engine, best_direct, tokens
        finally:
            pool.shutdown()
            await engine.close()

    engine_tps, direct_tps, tokens = asyncio.run(run())
    return {
        "backend": "transformers", "direct": "transformers model.generate", "prompts": args.prompts,
        "max_tokens": args.max_tokens, "tokens": tokens, "tokens_per_s": round(engine_tps, 1),
        "direct_tokens_per_s": round(direct_tps, 1), "ratio": round(engine_tps / direct_tps, 3) if direct_tps else None,
    }
