"""The order a push starts its two halves in (:meth:`WeightSync._send`): the trainer's sender
begins once every engine's receive took its first step (handing the manifest on), and a receive
that blocks the event loop (a fake fault: real receives await at once) delays the sender by at
most ``SENDER_START_WAIT_S``, not for as long as it blocks."""

from __future__ import annotations

import time

import pytest
from rollout_engines import create_engine
from rollout_engines.weights.session import SENDER_START_WAIT_S, connect_weight_sync
from wsync_helpers import tiny_state

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(120)]


def _record(engine, stamps: dict[str, float], *, block_s: float) -> None:
    """Wrap ``engine.receive_weights``: stamp its first step, after blocking the loop ``block_s``."""
    receive = engine.receive_weights

    async def receive_weights(manifest):
        time.sleep(block_s)  # synchronously, on the loop: what a slow hand-off (or a faulty receive) does
        stamps.setdefault("receiver_first_step_done", time.perf_counter())
        return await receive(manifest)

    engine.receive_weights = receive_weights


def _record_sender(sync, stamps: dict[str, float]) -> None:
    begin = sync.sender.begin

    def stamped(manifest):
        stamps.setdefault("sender_begin", time.perf_counter())
        return begin(manifest)

    sync.sender.begin = stamped


@pytest.mark.parametrize("block_s", [0.002, 0.3])
async def test_the_sender_begins_after_the_receives_first_step_but_never_waits_long(tiny_model, block_s):
    engine = create_engine("transformers", model=str(tiny_model), dtype="float32")
    try:
        sync = await connect_weight_sync([engine], "shm", bucket_bytes=2**18, timeout_s=60)
        try:
            stamps: dict[str, float] = {}
            _record(engine, stamps, block_s=block_s)
            _record_sender(sync, stamps)
            t0 = time.perf_counter()
            await sync.push(tiny_state(str(tiny_model), noise=1.0), version=engine.weight_version + 1)
            assert engine.weight_version == 1  # the push landed either way
            began = sync.last_send_timings["begin"]
            if block_s < SENDER_START_WAIT_S:  # a quick first step: the sender began after it
                assert stamps["sender_begin"] >= stamps["receiver_first_step_done"]
            else:  # a first step that blocks the loop: the sender did not wait for it
                assert stamps["sender_begin"] < stamps["receiver_first_step_done"]
                assert stamps["sender_begin"] - t0 < block_s / 2
                assert began < block_s / 2
        finally:
            await sync.close()
    finally:
        await engine.close()
