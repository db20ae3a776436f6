"""A trainer in its own process that stalls with buckets in flight, for the tests that kill the
trainer mid-stream and check that every engine keeps its previous weights: the trainer's side
(:func:`stalling_trainer`, importable by a spawned child; each backend's tests give it their own
update) and the test's (:func:`trainer_killed_mid_stream`)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

import torch

#: How long the stalled trainer sleeps: far past any test's timeout, so the test's kill ends it.
STALL_S = 600.0


def stalling_trainer(conn: Connection, transport: str, tensors: Callable[[], dict[str, torch.Tensor]],
                     stall_after: int, *, session_id: str, world_size: int, timeout_s: float, bucket_bytes: int,
                     options: dict[str, Any] | None = None) -> None:
    """Host ``transport``'s sender for a session of ``world_size`` ranks, send its spec options
    over ``conn``, take the manifest back from it and stream ``tensors()`` as one update; after
    ``stall_after`` tensors send ``"stalled"`` and sleep, so the test can kill this process."""
    from ..plugins import get_registry
    from ..weights.manifest import WeightManifest
    from ..weights.session import WeightSync

    cls = get_registry().transport(transport).load_sender()
    sender = cls(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options or {})
    conn.send(sender.spec_options())
    sender.connect()
    manifest = WeightManifest(**conn.recv())
    named = list(tensors().items())

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(named):
            if i == stall_after:
                conn.send("stalled")
                time.sleep(STALL_S)
            yield item

    sync = WeightSync([], sender, transport=transport, bucket_bytes=bucket_bytes, timeout_s=timeout_s,
                      checksum=manifest.checksum, progress=False)
    sync._stream(manifest, items())


def _recv(conn: Connection, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the trainer process sent nothing for {timeout_s} s")
    return conn.recv()


@contextlib.asynccontextmanager
async def trainer_killed_mid_stream(engine: Any, target: Callable[..., None], args: tuple[Any, ...], *,
                                    transport: str, session_id: str, tensors: Mapping[str, torch.Tensor],
                                    version: int, bucket_bytes: int,
                                    timeout_s: float) -> AsyncIterator[tuple[asyncio.Future[Any], Any]]:
    """Run ``target(conn, *args)`` (a function that calls :func:`stalling_trainer` with
    ``session_id``, ``world_size=2`` and ``bucket_bytes``) in a spawned process, join ``engine`` to its
    session, start the engine's receive of ``version`` with ``tensors``' layout, and kill the
    trainer once it stalled with buckets in flight. Yields the receive (a task that should fail) and
    the manifest; the trainer's process is gone and the receive ended or cancelled on exit."""
    from ..weights.manifest import TransportSpec, plan_manifest, specs_of

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    receiving: asyncio.Future[Any] | None = None
    try:
        options = await asyncio.to_thread(_recv, conn, 120.0)  # the child imports torch first
        await engine.init_weight_transfer(TransportSpec(transport=transport, session_id=session_id, world_size=2,
                                                        timeout_s=timeout_s, options=options))
        manifest = plan_manifest(specs_of(list(tensors.items())), version=version, bucket_bytes=bucket_bytes,
                                 transport=transport, timeout_s=timeout_s)
        conn.send(manifest.model_dump())
        receiving = asyncio.ensure_future(engine.receive_weights(manifest))
        said = await asyncio.to_thread(_recv, conn, 120.0)
        if said != "stalled":
            raise AssertionError(f"the trainer process said {said!r}, not 'stalled'")
        proc.kill()
        proc.join(30)
        yield receiving, manifest
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(30)
        if receiving is not None and not receiving.done():
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)
