"""The remote backend's part of the benchmarks (imported only by :mod:`rollout_engines.bench`).

``rollout-engines bench generate --backend remote`` (:func:`generate_baseline`, registered as the
backend's ``generate_baseline``): the same batch through a server (HTTP, JSON, another process)
and through the same backend in-process, in one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_engines.bench.generate import GenerateArgs

logger = logging.getLogger("rollout_engines.remote.bench")


@contextlib.contextmanager
def http_receivers(specs: list[dict[str, Any]], receivers: int, threads: int) -> Iterator[list[Any]]:
    """``bench weight-sync --transport http``: one server per receiver, each serving the benchmark's
    receiver engine, and a ``remote`` engine for each (what the trainer pushes to)."""
    from rollout_engines.factory import create_engine

    from .launch import ServerProcess

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        servers = []
        for i in range(receivers):
            server = ServerProcess(
                "bench-receiver", "-", log=tmp / f"server{i}.log",
                options={"specs": json.dumps(specs, separators=(",", ":")), "threads": threads},
                extra_args=["--factory", "rollout_engines.bench.weight_sync:BenchReceiverEngine",
                            "--max-bucket-bytes", str(64 * 2**30)],
            )
            servers.append(stack.enter_context(server))
        yield [create_engine("remote", model=s.url, api_key=s.api_key) for s in servers]


def generate_baseline(args: GenerateArgs) -> dict[str, Any]:
    """Starts a server of ``args.served_backend`` on ``args.model`` and runs the same batch through it
    and in-process; ``ratio`` = remote tokens/s / in-process tokens/s."""
    from rollout_engines.bench.generate import engine_tokens_per_s
    from rollout_engines.factory import create_engine

    from .launch import ServerProcess

    served, model, opts = args.served_backend, args.model_path(), args.options
    # The server parses each --option value as JSON where it can.
    server_opts = {k: v if isinstance(v, str) else json.dumps(v) for k, v in opts.items()}
    request = args.batch()
    repeats = args.repeats

    async def rounds(engine: Any) -> tuple[float, int]:
        best, tokens = 0.0, 0
        for _ in range(repeats):
            tps, tokens = await engine_tokens_per_s(engine, request)
            best = max(best, tps)
        return best, tokens

    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(served, model, options=server_opts, log=Path(tmp) / "server.log")
        with server:
            async def both() -> tuple[float, float | None, int, bool]:
                remote: Any = create_engine("remote", model=server.url, api_key=server.api_key)  # a RemoteEngine
                # Engines with worker processes (vLLM) pin and poll cores even when idle: two alive
                # at once slow each other down, so those sides run one after the other.
                separate = bool(remote.served.get("capabilities", {}).get("multi_process"))
                try:
                    await remote.generate(request)  # warm-up (and the connection pool)
                    if separate:
                        best_remote, tokens = await rounds(remote)
                        return best_remote, None, tokens, True
                    direct = await asyncio.to_thread(create_engine, served, model, **opts)
                    try:
                        await direct.generate(request)
                        best_remote = best_direct = 0.0
                        tokens = 0
                        # Alternating rounds: load from other processes hits both sides alike.
                        for _ in range(repeats):
                            tps, tokens = await engine_tokens_per_s(remote, request)
                            best_remote = max(best_remote, tps)
                            tps, _ = await engine_tokens_per_s(direct, request)
                            best_direct = max(best_direct, tps)
                        return best_remote, best_direct, tokens, False
                    finally:
                        await direct.close()
                finally:
                    await remote.close()

            remote_tps, direct_tps, tokens, separate = asyncio.run(both())

    if direct_tps is None:  # the server has exited: the in-process engine has the machine to itself
        async def direct_side() -> float:
            engine = await asyncio.to_thread(create_engine, served, model, **opts)
            try:
                await engine.generate(request)
                return (await rounds(engine))[0]
            finally:
                await engine.close()

        direct_tps = asyncio.run(direct_side())
    return {
        "backend": "remote", "served_backend": served, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "tokens": tokens, "tokens_per_s": round(remote_tps, 1), "direct_tokens_per_s": round(direct_tps, 1),
        "ratio": round(remote_tps / direct_tps, 3) if direct_tps else None,
        "rounds": "one after the other" if separate else "alternating",
    }
