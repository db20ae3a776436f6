"""Every CPU transport, across real processes: the engine runs in a child process (ProcessEngine),
the trainer in this one (or in a child that the test kills). Real gloo groups, real shared memory,
real files, a real TCPStore."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from rollout_engines.errors import ManifestMismatch, WeightSyncError
from rollout_engines.testing.trainer import trainer_killed_mid_stream
from rollout_engines.weights.buckets import BucketHeader
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


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
async def test_trainer_killed_mid_stream(engine, transport, tmp_path):
    before = await outputs(engine)
    segments_before = shm_segments()
    timeout_s = 6.0 if transport == "disk" else 60.0  # disk has no liveness channel: only its timeout
    # A killed trainer cannot remove its temporary directory: give it one that pytest removes.
    options = {"path": str(tmp_path)} if transport == "disk" else {}
    # The trainer stalls after 3 tensors: bucket 0 (at least) is on its way when it is killed.
    async with trainer_killed_mid_stream(engine, trainer_main, (transport, 2, timeout_s, options, 1, 3),
                                         transport=transport, session_id="killed-trainer", tensors=state(1),
                                         version=7, bucket_bytes=BUCKET, timeout_s=timeout_s) as (receiving, manifest):
        assert len(manifest.buckets) >= 3
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


def test_gloo_a_late_failure_report_of_an_aborted_update_does_not_fail_the_next():
    """The trainer aborts v1 while the receiver applies bucket 0 and starts v2 at once; the
    receiver reports its failure of v1 only after v2 began. v2 lands all the same."""
    from rollout_engines.weights.transports._store import CHECK_EVERY_S
    from rollout_engines.weights.transports.broadcast import GlooReceiver, GlooSender

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sender = GlooSender(session_id="late-report", world_size=2, timeout_s=30, options={})
    spec = TransportSpec(transport="gloo", session_id="late-report", world_size=2, timeout_s=30,
                         options=sender.spec_options())
    receiver = GlooReceiver(spec, rank=1)
    joining = threading.Thread(target=receiver.connect)
    joining.start()
    sender.connect()
    joining.join(30)
    v1, v2 = (plan_manifest(specs_of([("a", torch.zeros(256)), ("b", torch.zeros(256))]), version=v, bucket_bytes=1024,
                            transport="gloo", timeout_s=30) for v in (1, 2))
    assert len(v1.buckets) == 2
    v1_started, got, errors = threading.Event(), [], []

    def receive() -> None:
        try:
            receiver.begin(v1)
            ok = False
            try:
                receiver.recv_bucket(0, v1.buckets[0].nbytes)
                v1_started.set()
                time.sleep(1.0)  # applying bucket 0 while the trainer aborts v1 and starts v2
                receiver.release(0)
                ok = receiver.recv_bucket(1, v1.buckets[1].nbytes)[0].status != BucketHeader.ABORT
            finally:
                deadline = time.monotonic() + 30
                while not receiver._kv.check([f"update/{v2.session_id}"]) and time.monotonic() < deadline:
                    time.sleep(0.01)  # the trainer began v2
                receiver.end(v1, ok)  # the failure report of v1, after v2 began
            receiver.begin(v2)
            for b in v2.buckets:
                got.append(receiver.recv_bucket(b.index, b.nbytes)[1].clone())
                time.sleep(2 * CHECK_EVERY_S)  # the trainer checks on its receivers meanwhile
                receiver.release(b.index)
            receiver.end(v2, True)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    receiving = threading.Thread(target=receive)
    receiving.start()
    try:
        sender.begin(v1)
        sender.send_bucket(BucketHeader(index=0, nbytes=v1.buckets[0].nbytes), torch.zeros(v1.buckets[0].nbytes, dtype=torch.uint8))
        assert v1_started.wait(30)
        sender.abort("the trainer's iterator failed")
        sender.begin(v2)
        for b in v2.buckets:
            sender.send_bucket(BucketHeader(index=b.index, nbytes=b.nbytes), torch.full((b.nbytes,), 7, dtype=torch.uint8))
        sender.end(v2)
    finally:
        receiving.join(60)
        sender.close()
        receiver.close()
    assert not errors, errors
    assert [int(t.min()) for t in got] == [7] * len(v2.buckets) and [int(t.max()) for t in got] == [7] * len(v2.buckets)


def _aborting_then_killed_trainer(conn, session_id: str) -> None:
    """Aborts update 1 after publishing its bucket 0 (bucket 1 was packed into a second segment),
    then packs update 2's bucket 0 into a fresh segment and waits to be killed."""
    from rollout_engines.weights.manifest import WeightManifest
    from rollout_engines.weights.transports.shm import ShmSender

    sender = ShmSender(session_id=session_id, world_size=2, timeout_s=30, options={})
    conn.send(sender.spec_options())
    sender.connect()
    v1 = WeightManifest(**conn.recv())
    sender.begin(v1)
    nbytes = [b.nbytes for b in v1.buckets]
    sender.send_bucket(BucketHeader(index=0, nbytes=nbytes[0]), sender.bucket_buffer(0, nbytes[0]))
    sender.bucket_buffer(1, nbytes[1])
    conn.recv()  # the receiver has bucket 0
    sender.abort("the trainer's iterator failed")
    v2 = WeightManifest(**conn.recv())
    sender.begin(v2)
    sender.bucket_buffer(0, nbytes[0])
    conn.send("packing")
    time.sleep(600)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="counts segments in /dev/shm")
@pytest.mark.parametrize("listed", [True, False], ids=["segments-listed", "segments-unlisted"])
def test_shm_segments_of_a_trainer_killed_after_an_abort_are_removed(monkeypatch, listed):
    from rollout_engines.weights.transports import shm

    if not listed:  # where segments cannot be listed, the receiver counts the ones the trainer made
        monkeypatch.setattr(shm, "_SHM_DIR", "/nonexistent", raising=False)
    session_id = f"abortkill{os.getpid()}{int(listed)}"
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_aborting_then_killed_trainer, args=(child, session_id))
    proc.start()
    receiver = None
    try:
        spec = TransportSpec(transport="shm", session_id=session_id, world_size=2, timeout_s=30, options=conn.recv())
        receiver = shm.ShmReceiver(spec, rank=1)
        receiver.connect()
        v1, v2 = (plan_manifest(specs_of([("a", torch.zeros(256)), ("b", torch.zeros(256))]), version=v,
                                bucket_bytes=1024, transport="shm", timeout_s=30) for v in (1, 2))
        conn.send(v1.model_dump())
        receiver.begin(v1)
        receiver.recv_bucket(0, v1.buckets[0].nbytes)
        receiver.release(0)
        conn.send("go on")
        with pytest.raises(WeightSyncError, match="aborted"):
            receiver.recv_bucket(1, v1.buckets[1].nbytes)
        receiver.end(v1, False)
        conn.send(v2.model_dump())
        assert conn.recv() == "packing"
        assert len(shm_segments() & {f"roe_{session_id}_{n}" for n in range(1, 9)}) == 1  # update 2's bucket 0
        receiver.begin(v2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(WeightSyncError, match="trainer"):
            receiver.recv_bucket(0, v2.buckets[0].nbytes)
        receiver.end(v2, False)
        assert not {n for n in shm_segments() if n.startswith(f"roe_{session_id}_")}
    finally:
        if receiver is not None:
            receiver.close()
        if proc.is_alive():
            proc.kill()
        for name in shm_segments():
            if name.startswith(f"roe_{session_id}_"):
                os.unlink(f"/dev/shm/{name}")


def tcp_sockets(port: int) -> list[str]:
    """States (``/proc/net/tcp`` hex codes: ``0A`` listening, ``01`` connected, ...) of every TCP
    socket of this host with ``port`` at either end, read without opening a connection."""
    states = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:] if Path(table).exists() else []:
            local, remote, st = line.split()[1:4]
            if port in (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)):
                states.append(st)
    return states


LISTEN, TIME_WAIT = "0A", "06"


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket table from /proc/net/tcp")
@pytest.mark.parametrize("transport", ["gloo", "shm"])
async def test_a_closed_session_stops_hosting_its_store_and_engines_hang_up(engine, transport):
    sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=30)
    port = sync.sender.spec_options()["port"]
    await sync.push(state(1), version=1)
    assert LISTEN in tcp_sockets(port)
    await sync.close()
    # No listener, and no connection left open at either end (closed ones linger in TIME_WAIT);
    # the store's threads take a moment to see the other end close.
    deadline = time.monotonic() + 10
    while not set(tcp_sockets(port)) <= {TIME_WAIT}:
        assert time.monotonic() < deadline, tcp_sockets(port)
        await asyncio.sleep(0.05)


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


def test_an_abandoned_gloo_group_is_let_go_once_its_collectives_timed_out(monkeypatch):
    """A gloo group a failed update left behind is parked (destroying it at once would block on
    its pending collectives) only until its own timeout has passed; a later drop lets it go, so
    failed updates do not pile up groups and their threads for the life of the process."""
    import datetime

    from rollout_engines.weights.transports import broadcast
    from torch.distributed import HashStore, ProcessGroupGloo

    monkeypatch.setattr(broadcast, "_abandoned", [])
    monkeypatch.setattr(broadcast, "ABANDON_SLACK_S", 0.2)

    def group():
        return ProcessGroupGloo(HashStore(), 0, 1, datetime.timedelta(seconds=5))

    short, long = group(), group()
    broadcast._drop_group(short, failed=True, timeout_s=0.0)
    broadcast._drop_group(long, failed=True, timeout_s=60.0)
    assert [g for _, g in broadcast._abandoned] == [short, long]
    broadcast._drop_group(group(), failed=False, timeout_s=0.0)  # a clean close parks nothing
    assert [g for _, g in broadcast._abandoned] == [short, long]
    time.sleep(0.3)
    broadcast._drop_group(None, timeout_s=0.0)
    assert [g for _, g in broadcast._abandoned] == [long]  # past its timeout: let go; the other stays
