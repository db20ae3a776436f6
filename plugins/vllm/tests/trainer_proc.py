"""A trainer in its own process, for the tests that kill the trainer mid-stream (importable by a
spawned child)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.manifest import WeightManifest

SESSION = "killed-trainer"


def update(model_path: str) -> dict[str, torch.Tensor]:
    """The update every test pushes: the model's own checkpoint with seeded noise added."""
    return perturbed(load_checkpoint(model_path))


def trainer_main(conn: Connection, transport: str, timeout_s: float, model_path: str, bucket_bytes: int,
                 stall_after: int) -> None:
    """Host the sender of a one-engine session, stream one update and stall after ``stall_after``
    tensors (announcing it), so the test can kill this process with buckets in flight."""
    from rollout_engines.plugins import get_registry
    from rollout_engines.weights.session import WeightSync

    cls = get_registry().transport(transport).load_sender()
    sender = cls(session_id=SESSION, world_size=2, timeout_s=timeout_s, options={})
    conn.send(sender.spec_options())
    sender.connect()
    manifest = WeightManifest(**conn.recv())
    named = list(update(model_path).items())

    def items() -> Any:
        for i, item in enumerate(named):
            if i == stall_after:
                conn.send("stalled")
                time.sleep(600)
            yield item

    sync = WeightSync([], sender, transport=transport, bucket_bytes=bucket_bytes, timeout_s=timeout_s,
                      checksum=manifest.checksum, progress=False)
    sync._stream(manifest, items())
