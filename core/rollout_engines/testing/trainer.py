"""A trainer in its own process that stalls with buckets in flight, for the tests that kill the
trainer mid-stream and check that every engine keeps its previous weights (importable by a spawned
child; each backend's tests give it their own update)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
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
