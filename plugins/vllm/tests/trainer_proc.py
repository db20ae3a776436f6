"""A trainer in its own process, for the tests that kill the trainer mid-stream (importable by a
spawned child)."""

from __future__ import annotations

from multiprocessing.connection import Connection

import torch
from rollout_engines.testing.trainer import stalling_trainer
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed

SESSION = "killed-trainer"


def update(model_path: str) -> dict[str, torch.Tensor]:
    """The update every test pushes: the model's own checkpoint with seeded noise added."""
    return perturbed(load_checkpoint(model_path))


def trainer_main(conn: Connection, transport: str, timeout_s: float, model_path: str, bucket_bytes: int,
                 stall_after: int) -> None:
    """Host the sender of a one-engine session, stream one update and stall after ``stall_after``
    tensors (announcing it), so the test can kill this process with buckets in flight."""
    stalling_trainer(conn, transport, lambda: update(model_path), stall_after, session_id=SESSION, world_size=2,
                     timeout_s=timeout_s, bucket_bytes=bucket_bytes)
