"""The weight doorbell (rollout_engines.weights.doorbell): a host hands updates to worker threads
through a real session store (the one ``shm``/``cuda_ipc`` signal through), signed with the
session's secret. The listeners here run ``receive`` functions of the test; plugins/vllm's tests
ring real vLLM workers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import torch.distributed as dist
from rollout_engines.errors import EngineUnavailable, WeightSyncError
from rollout_engines.weights.doorbell import Doorbell, DoorbellListener, has_store, new_door
from rollout_engines.weights.manifest import TransportSpec
from rollout_engines.weights.transports import _store


@pytest.fixture
def spec():
    store, options = _store.host_store({}, 30.0)
    yield TransportSpec(transport="shm", session_id="s" * 16, rank_offset=1, world_size=3, timeout_s=30.0,
                        options=options)
    del store


def wire(version: int, layout: str = '{"tensors": []}') -> dict:
    return {"version": version, "session_id": f"u{version}", "partial": False, "allow_rollback": False,
            "layout": layout}


class Workers:
    """Two listeners (ranks 1 and 2) that record what they were handed."""

    def __init__(self, spec: TransportSpec, door: str, answer=None) -> None:
        self.got: dict[int, list[dict]] = {1: [], 2: []}
        self.lock = threading.Lock()

        def receiver(rank):
            def receive(w):
                self.got[rank].append(w)
                if answer is not None:
                    return answer(rank, w)
                return {"ok": True, "version": w["version"], "rank": rank}
            return receive

        self.listeners = [DoorbellListener(spec, door, rank=r, receive=receiver(r), lock=self.lock) for r in (1, 2)]

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()


@contextlib.contextmanager
def rigged(spec: TransportSpec, answer=None, go: threading.Event | None = None):
    """Two listening workers and the host's doorbell, closed afterwards (``go`` set first, so that
    workers held by it let go)."""
    door = new_door()
    workers = Workers(spec, door, answer)
    bell = Doorbell(spec, door, [1, 2])
    try:
        yield door, workers, bell
    finally:
        if go is not None:
            go.set()
        workers.close()
        bell.close()


async def test_rings_reach_every_worker_with_the_layout_stored_once(spec, wait_until):
    assert has_store(spec) and not has_store(spec.model_copy(update={"options": {}}))
    with rigged(spec) as (door, workers, bell):
        layout = '{"tensors": [1, 2, 3]}'
        for v in (1, 2, 3):
            assert bell.claim()
            answers = await bell.ring(wire(v, layout), timeout_s=10, check=lambda: None)
            assert answers == [{"ok": True, "version": v, "rank": 1}, {"ok": True, "version": v, "rank": 2}]
            assert not bell.busy
        other = '{"tensors": [4]}'
        assert bell.claim()
        await bell.ring(wire(4, other), timeout_s=10, check=lambda: None)
        for rank in (1, 2):
            assert [w["version"] for w in workers.got[rank]] == [1, 2, 3, 4]
            assert [w["layout"] for w in workers.got[rank]] == [layout] * 3 + [other]
        # A listener counts its ring and tidies up after its answer is stored, so the host may wake
        # before either: wait for them.
        assert bell.rings == 4
        await wait_until(lambda: all(listener.rings == 4 for listener in workers.listeners), "every listener counts 4")
        # the listeners tidied up after answering: the last ring's keys and the current layout remain
        kv = _store.session_store(_store.join_store(spec.options, 10), spec.session_id, spec.options["secret"])
        await wait_until(lambda: not kv.check([f"door/{door}/1/1"]) and not kv.check([f"door/{door}/3/done/2"]),
                         "the listeners to delete the earlier rings' keys")
        assert kv.check([f"door/{door}/4/done/1"]) and not kv.check([f"door/{door}/layout/1"])
    assert not any(listener._thread.is_alive() for listener in workers.listeners)


def test_a_claim_no_ring_follows_is_released(spec):
    """An engine claims first and counts its requests after; busy after all, it releases the claim."""
    with rigged(spec) as (_, workers, bell):
        assert bell.claim() and bell.busy and not bell.claim()
        bell.release()
        assert not bell.busy and bell.claim()
        bell.release()
        assert bell.rings == 0 and not workers.got[1] and not workers.got[2]


async def test_a_ring_without_the_secret_runs_nothing(spec):
    with rigged(spec) as (door, workers, bell):
        # Whoever can reach the store but lacks the session's secret writes a "ring".
        forged = _store.session_store(_store.join_store(spec.options, 10), spec.session_id, "ab" * 32)
        forged.set(f"door/{door}/1/1", '{"version": 9, "layout": 1}')
        time.sleep(0.3)
        assert workers.got == {1: [], 2: []}
        assert all(listener._thread.is_alive() for listener in workers.listeners)
        assert bell.claim()
        answers = await bell.ring(wire(1), timeout_s=10, check=lambda: None)
        assert [a["version"] for a in answers] == [1, 1]
        assert [w["version"] for w in workers.got[1]] == [1]


async def test_an_answer_without_the_secret_is_not_taken_for_the_workers(spec, caplog):
    go, receiving = threading.Event(), threading.Event()

    def answer(rank, w):
        receiving.set()
        go.wait(10)  # a receive that takes a while
        return {"ok": True, "version": w["version"], "rank": rank}

    with rigged(spec, answer, go) as (door, workers, bell):
        assert bell.claim()
        ring = asyncio.ensure_future(bell.ring(wire(1), timeout_s=10, check=lambda: None))
        assert await asyncio.to_thread(receiving.wait, 10)
        # Whoever can reach the store but lacks the session's secret "answers" for both workers.
        forged = _store.session_store(_store.join_store(spec.options, 10), spec.session_id, "ab" * 32)
        for rank in (1, 2):
            forged.set(f"door/{door}/1/done/{rank}", '{"ok": true, "version": 1}')
        await asyncio.sleep(0.5)
        assert not ring.done() and bell.busy  # the workers still receive: the engine must not run requests
        go.set()
        answers = await asyncio.wait_for(ring, 10)
        assert answers == [{"ok": True, "version": 1, "rank": 1}, {"ok": True, "version": 1, "rank": 2}]
        assert not bell.busy and bell.broken is None
        assert sum("not signed" in r.getMessage() for r in caplog.records) == 1  # logged once


async def test_a_worker_error_comes_back_as_its_answer(spec):
    def answer(rank, w):
        if rank == 2:
            raise WeightSyncError("rank 2 lost a bucket")
        return {"ok": True, "version": w["version"]}

    with rigged(spec, answer) as (door, workers, bell):
        assert bell.claim()
        first, second = await bell.ring(wire(1), timeout_s=10, check=lambda: None)
        assert first["ok"] is True
        assert second["ok"] is False and "rank 2 lost a bucket" in second["message"]
        assert bell.claim()  # the doorbell still works
        assert len(await bell.ring(wire(2), timeout_s=10, check=lambda: None)) == 2


async def test_busy_until_every_worker_answered_even_if_the_caller_gives_up(spec):
    go = threading.Event()
    with rigged(spec, lambda rank, w: (go.wait(10), {"ok": True})[1], go) as (door, workers, bell):
        assert bell.claim() and not bell.claim()
        task = asyncio.ensure_future(bell.ring(wire(1), timeout_s=10, check=lambda: None))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert bell.busy  # the workers still receive: the engine must not run requests yet
        go.set()
        deadline = time.monotonic() + 10
        while bell.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not bell.busy and bell.claim()
        assert [a["ok"] for a in await bell.ring(wire(2), timeout_s=10, check=lambda: None)] == [True, True]


async def test_a_silent_worker_breaks_the_doorbell_within_the_timeout(spec):
    go = threading.Event()
    with rigged(spec, lambda rank, w: (go.wait(30) if rank == 2 else None, {"ok": True})[1], go) as (door, workers, bell):
        assert bell.claim()
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="did not answer update v1 within 1 s"):
            await bell.ring(wire(1), timeout_s=1, check=lambda: None)
        assert time.monotonic() - start < 10
        assert bell.broken is not None and not bell.busy and not bell.claim()


async def test_a_failed_engine_ends_the_wait(spec):
    go = threading.Event()

    def check():
        raise EngineUnavailable("the engine core died")

    with rigged(spec, lambda rank, w: (go.wait(30), {"ok": True})[1], go) as (door, workers, bell):
        assert bell.claim()
        start = time.monotonic()
        with pytest.raises(EngineUnavailable, match="engine core died"):
            await bell.ring(wire(1), timeout_s=60, check=check)
        assert time.monotonic() - start < 10


def test_listeners_stop_when_closed_or_when_the_store_goes():
    store, options = _store.host_store({}, 30.0)
    spec = TransportSpec(transport="shm", session_id="t" * 16, rank_offset=1, world_size=2, timeout_s=30.0,
                         options=options)
    listener = DoorbellListener(spec, new_door(), rank=1, receive=lambda w: {"ok": True}, lock=threading.Lock())
    start = time.monotonic()
    listener.close()
    assert not listener._thread.is_alive() and time.monotonic() - start < 5
    listener = DoorbellListener(spec, new_door(), rank=1, receive=lambda w: {"ok": True}, lock=threading.Lock())
    del store  # the trainer, the store's host, is gone
    import gc

    gc.collect()
    listener._thread.join(10)
    assert not listener._thread.is_alive()
    assert isinstance(dist.DistStoreError("x"), RuntimeError)


async def test_a_long_push_logs_one_timed_out_wait_not_one_per_health_check(spec, monkeypatch, capfd):
    """The host blocks in the store for its answers, checking the engine's health between waits.
    Each blocked wait that times out makes the store's client log two warnings; a push that
    outlasts the first wait is polled for from then on, so it logs them once, however long it
    takes, and its answers still come back."""
    from rollout_engines.weights import doorbell

    monkeypatch.setattr(doorbell, "ANSWER_WAIT_S", 0.2)  # a 1.2 s push: six health checks
    checks = []
    with rigged(spec, lambda rank, w: (time.sleep(1.2), {"ok": True, "rank": rank})[1]) as (door, workers, bell):
        capfd.readouterr()
        assert bell.claim()
        answers = await bell.ring(wire(1), timeout_s=30, check=lambda: checks.append(time.monotonic()))
        err = capfd.readouterr().err
    assert answers == [{"ok": True, "rank": 1}, {"ok": True, "rank": 2}]
    assert len(checks) >= 4  # the engine's health was still checked while the push ran
    assert err.count("timed out after") == 1, err[:2000]
