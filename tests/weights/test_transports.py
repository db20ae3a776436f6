"""Every CPU transport, across real processes: the engine runs in a child process (ProcessEngine),
the trainer in this one (or in a child that the test kills). Real gloo groups, real shared memory,
real files, a real TCPStore."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from rollout_engines.errors import ManifestMismatch, WeightSyncError
from rollout_engines.weights.manifest import TransportSpec, plan_manifest, specs_of
from rollout_engines.weights.session import connect_weight_sync
from wsync_helpers import BUCKET, PROMPTS, module_engine_process, outputs, state, trainer_main

CPU_TRANSPORTS = ["gloo", "shm", "disk"]
pytestmark = pytest.mark.timeout(180)


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("roe_*")} if Path("/dev/shm").is_dir() else set()


@pytest.fixture
async def engine():
    eng = module_engine_process()
    yield eng
    await eng.close()


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_push_changes_outputs_and_restore_restores(engine, transport):
    before = await outputs(engine)
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=30)
    try:
        await sync.push(state(1), version=1)
        changed = await outputs(engine)
        assert changed != before
        assert (await engine.info()).weight_version == 1
        await sync.push(state(0), version=2)
        assert await outputs(engine) == before
        assert (await engine.generate(PROMPTS))[0].weight_version == 2
    finally:
        await sync.close()


async def test_two_engines_over_gloo():
    engines = [module_engine_process(), module_engine_process("inplace")]
    try:
        before = [await outputs(e) for e in engines]
        assert before[0] == before[1]
        sync = await connect_weight_sync(engines, "gloo", bucket_bytes=BUCKET, timeout_s=30)
        await sync.push(state(2), version=5)
        after = [await outputs(e) for e in engines]
        assert after[0] == after[1] != before[0]
        assert [(await e.info()).weight_version for e in engines] == [5, 5]
        await sync.close()
    finally:
        for e in engines:
            await e.close()


def _bad(kind: str) -> dict[str, torch.Tensor]:
    sd = state(1)
    if kind == "unknown":
        sd["lm_head.extra"] = torch.zeros(4)
    elif kind == "shape":
        sd["mid.weight"] = torch.zeros(3, 3)
    else:
        sd["mid.weight"] = sd["mid.weight"].double()
    return sd


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_bad_manifest_rejected_whole_then_next_push_works(engine, transport):
    before = await outputs(engine)
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=30)
    try:
        for kind, words in (("unknown", "unknown tensor 'lm_head.extra'"), ("shape", "shape [3, 3]"),
                            ("dtype", "dtype float64")):
            with pytest.raises(WeightSyncError) as info:
                await sync.push(_bad(kind), version=9)
            cause = info.value.failures[0][1]
            assert isinstance(cause, ManifestMismatch), info.value
            assert words in str(cause)
            assert await outputs(engine) == before
            assert (await engine.info()).weight_version == 0
        await sync.push(state(1), version=10)
        assert await outputs(engine) != before
    finally:
        await sync.close()


async def _start_killable_trainer(engine, transport, timeout_s, options, stall_after):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=trainer_main, args=(child, transport, 2, timeout_s, options, 1, stall_after))
    proc.start()
    spec_options = await asyncio.to_thread(parent.recv)
    spec = TransportSpec(transport=transport, session_id="killed-trainer", rank_offset=1, world_size=2,
                         timeout_s=timeout_s, options=spec_options)
    await engine.init_weight_transfer(spec)
    manifest = plan_manifest(specs_of(list(state(1).items())), version=7, bucket_bytes=BUCKET,
                             transport=transport, timeout_s=timeout_s)
    assert len(manifest.buckets) >= 3
    parent.send(manifest.model_dump())
    return proc, parent, manifest


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_trainer_killed_mid_stream(engine, transport, tmp_path):
    before = await outputs(engine)
    segments_before = shm_segments()
    timeout_s = 6.0 if transport == "disk" else 60.0  # disk has no liveness channel: only its timeout
    # A killed trainer cannot remove its temporary directory: give it one that pytest removes.
    options = {"path": str(tmp_path)} if transport == "disk" else {}
    proc, conn, manifest = await _start_killable_trainer(engine, transport, timeout_s, options, stall_after=3)
    receiving = asyncio.ensure_future(engine.receive_weights(manifest))
    assert await asyncio.to_thread(conn.recv) == "stalled"  # bucket 0 (at least) is on its way
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    with pytest.raises(WeightSyncError) as info:
        await asyncio.wait_for(receiving, timeout_s + 30)
    msg = str(info.value)
    assert "peer: trainer (rank 0)" in msg and "bucket: " in msg, msg
    # Staged apply: nothing of the interrupted update is served.
    assert await outputs(engine) == before
    assert (await engine.info()).weight_version == 0
    if transport == "shm":
        assert shm_segments() <= segments_before  # the engine unlinked what the dead trainer left
    # A new trainer session works right away.
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=30)
    await sync.push(state(1), version=8)
    assert await outputs(engine) != before
    await sync.close()


@pytest.mark.parametrize("transport", ["gloo", "shm"])
async def test_engine_killed_mid_stream(transport):
    victim, survivor = module_engine_process(), module_engine_process()
    try:
        sync = await connect_weight_sync([victim, survivor], transport, bucket_bytes=BUCKET, timeout_s=60,
                                         options={"dead_after_s": 2.0})

        def items():
            for i, item in enumerate(state(1).items()):
                if i == 3:
                    os.kill(victim.pid, signal.SIGKILL)
                yield item

        with pytest.raises(WeightSyncError) as info:
            await asyncio.wait_for(sync.push(items(), version=3), 60)
        msg = str(info.value)
        assert "sender:" in msg and "rank 1" in msg and "bucket: " in msg, msg
        assert (await survivor.info()).weight_version == 0
        await sync.close()
        # The survivor takes the next push from a new session.
        sync = await connect_weight_sync([survivor], transport, bucket_bytes=BUCKET, timeout_s=30)
        await sync.push(state(1), version=4)
        assert (await survivor.info()).weight_version == 4
        await sync.close()
    finally:
        await victim.close()
        await survivor.close()


async def fails_then_the_same_session_recovers(engine, transport: str, timeout_s: float, fault) -> WeightSyncError:
    """Push ``state(1)`` calling ``fault()`` before its fourth tensor: the push fails with nothing
    applied, and the same session's next push lands. Returns the failure."""
    before = await outputs(engine)
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=timeout_s)
    try:
        def items():
            for i, item in enumerate(state(1).items()):
                if i == 3:
                    fault()
                yield item

        with pytest.raises(WeightSyncError) as info:
            await sync.push(items(), version=1, specs=specs_of(list(state(1).items())))
        assert await outputs(engine) == before
        await sync.push(state(1), version=2)  # (gloo rebuilds its group)
        assert await outputs(engine) != before
        assert (await engine.info()).weight_version == 2
    finally:
        await sync.close()
    return info.value


async def test_an_iterator_shorter_than_its_specs_fails_naming_the_first_missing_tensor(engine):
    """A lazy push (``specs=``) whose iterator ends early fails naming the first tensor it never
    gave, with nothing applied; the same session's next push lands."""
    before = await outputs(engine)
    full = list(state(1).items())
    sync = await connect_weight_sync([engine], "shm", bucket_bytes=BUCKET, timeout_s=30)
    try:
        with pytest.raises(WeightSyncError, match=f"ended before '{full[-2][0]}'"):
            await sync.push(iter(full[:-2]), version=1, specs=specs_of(full))
        assert await outputs(engine) == before
        await sync.push(state(1), version=2)
        assert await outputs(engine) != before
    finally:
        await sync.close()

@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_receiver_timeout_then_same_session_recovers(engine, transport):
    def slow() -> None:
        time.sleep(3.5)  # longer than the receivers' timeout

    error = await fails_then_the_same_session_recovers(engine, transport, 2.0, slow)
    engine_error = str(error.failures[0][1])  # type: ignore[attr-defined]
    assert "peer: trainer (rank 0)" in engine_error and "bucket: " in engine_error, engine_error


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_sender_abort_then_same_session_recovers(engine, transport):
    def broken() -> None:
        raise RuntimeError("gathering shard 3 failed")

    error = await fails_then_the_same_session_recovers(engine, transport, 30, broken)
    assert "gathering shard 3 failed" in str(error)


async def test_shm_leaves_no_segments(engine):
    segments_before = shm_segments()
    sync = await connect_weight_sync([engine], "shm", bucket_bytes=BUCKET, timeout_s=30)
    await sync.push(state(1), version=1)
    assert len(shm_segments() - segments_before) == 2  # two slots, reused in turn
    await sync.close()
    assert shm_segments() <= segments_before


async def test_disk_load_latest(tmp_path, engine):
    from rollout_engines.weights.transports.disk import load_latest

    sync = await connect_weight_sync([engine], "disk", bucket_bytes=BUCKET, timeout_s=30,
                                     options={"path": str(tmp_path), "keep": 2})
    for v in (1, 2, 3):
        await sync.push(state(v), version=v)
    await sync.close()
    assert len(list(tmp_path.iterdir())) == 2  # older versions pruned
    # An interrupted update (no manifest.json) is ignored by recovery.
    (tmp_path / "v00000009-interrupted").mkdir()
    manifest, tensors = load_latest(tmp_path)
    assert manifest.version == 3
    for name, t in state(3).items():
        assert torch.equal(tensors[name], t)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_nccl_without_a_gpu_is_refused_with_the_cpu_alternative():
    """``nccl`` cannot run on a CPU: both halves say so, naming ``gloo``, before any data moves."""
    from rollout_engines.bench.weight_sync import BenchReceiverEngine
    from rollout_engines.types import EngineConfig
    from rollout_engines.weights.manifest import TensorSpec
    from rollout_engines.weights.session import connect_weight_sync
    from rollout_engines.weights.transports.broadcast import NcclReceiver

    spec = TensorSpec(name="w", dtype="float32", shape=(4,))
    engine = BenchReceiverEngine(EngineConfig(backend="bench-receiver", model="-", options={"specs": [spec.model_dump()]}))
    with pytest.raises(WeightSyncError, match="nccl needs a CUDA device.*gloo"):
        asyncio.run(connect_weight_sync([engine], "nccl", timeout_s=5))
    tspec = TransportSpec(transport="nccl", session_id="s", world_size=2, timeout_s=5, options={})
    with pytest.raises(WeightSyncError, match="CUDA device, not cpu.*gloo"):
        NcclReceiver(tspec, rank=1, device="cpu")
