"""Attacks on weight sync, with real processes and components (issue 15).

The trainer side (``WeightSync``) runs in this process; the engines are real transformers engines on
the tiny model: in a child process (``ProcessEngine``) for the cross-process transports, in this
process where a test needs to look inside. An attacker on the host writes to the trainer's
rendezvous store with a raw ``TCPStore`` client; it knows the store's port and the session's key
prefix, never the session's secret. Every test checks that the engine either applies an honest
update or refuses with the documented error and keeps serving its previous weights, that innocent
requests still succeed, and that nothing waits long.
"""

from __future__ import annotations

import ast
import asyncio
import datetime
import json
import os
import secrets
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import rollout_engines
import torch
import torch.distributed as dist
from pydantic import ValidationError
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams, create_engine
from rollout_engines.errors import CapabilityError, ManifestMismatch, StaleVersion, WeightSyncError
from rollout_engines.process import ProcessEngine
from rollout_engines.weights.buckets import checksum
from rollout_engines.weights.manifest import (
    MAX_TIMEOUT_S,
    BucketSpec,
    TransportSpec,
    WeightManifest,
    check_timeout,
    plan_manifest,
    specs_of,
)
from rollout_engines.weights.session import connect_weight_sync
from rollout_engines.weights.transports._store import SignedStore

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(120)]

GREEDY = GenerateRequest(prompt_token_ids=[[5, 6, 7], [100, 200]], sampling=SamplingParams(temperature=0, max_tokens=8))
BUCKET = 2**18  # the tiny model (~3 MB) goes in many buckets
TIMEOUT = 15.0  # every session's waits (short: a test that would wait for it fails its time bound)
WAIT = 60.0  # bound on any single await of a test
MISSING = "model.layers.1.mlp.up_proj.weight"  # a tensor that is not tied to another


# ---- fixtures and helpers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tiny_model):
    return str(tiny_model)


@pytest.fixture(scope="module")
def proc_engine(tiny_path):
    """A real transformers engine in a child process (the proxy is loop-agnostic: one for the module)."""
    eng = ProcessEngine(EngineConfig(backend="transformers", model=tiny_path, dtype="float32", device="cpu"))
    yield eng
    asyncio.run(eng.close())


@pytest.fixture
async def local_engine(tiny_path):
    """A real transformers engine in this process (staged apply, the default)."""
    eng = create_engine("transformers", model=tiny_path, dtype="float32", device="cpu")
    yield eng
    await asyncio.wait_for(eng.close(), WAIT)


@pytest.fixture(scope="module")
def states(tiny_path):
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).state_dict()
    orig = {k: v.detach().clone().contiguous() for k, v in sd.items()}
    gen = torch.Generator().manual_seed(0)
    new = {k: (v + torch.randn(v.shape, generator=gen)).contiguous() for k, v in orig.items()}
    return {"orig": orig, "new": new}


async def greedy(engine) -> list[list[int]]:
    return [c.token_ids for c in await asyncio.wait_for(engine.generate(GREEDY), WAIT)]


async def innocent(engine, times: int = 3) -> list[list[list[int]]]:
    """Innocent requests, one after another; each must succeed."""
    out = []
    for _ in range(times):
        ids = await greedy(engine)
        assert len(ids) == 2 and all(ids), ids
        out.append(ids)
    return out


async def connect(engine, transport: str, **kw):
    kw.setdefault("timeout_s", TIMEOUT)
    return await asyncio.wait_for(connect_weight_sync([engine], transport, bucket_bytes=BUCKET, **kw), WAIT)


async def push(sync, tensors, version: int, **kw) -> int:
    return await asyncio.wait_for(sync.push(tensors, version=version, **kw), WAIT)


async def honest_round_trip(engine, sync, states, before) -> None:
    """The session still works: an honest push changes the outputs, a second restores them."""
    version = engine.weight_version
    await push(sync, states["new"], version + 1)
    assert await greedy(engine) != before
    assert engine.weight_version == version + 1
    await push(sync, states["orig"], version + 2)
    assert await greedy(engine) == before


def manifest_for(states, version: int, transport: str, **kw) -> WeightManifest:
    return plan_manifest(specs_of(list(states["new"].items())), version=version, bucket_bytes=BUCKET,
                         transport=transport, timeout_s=TIMEOUT, **kw)


def attacker_store(port: int) -> dist.TCPStore:
    """What anyone on the host can do: connect a client to the trainer's store on loopback."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def listeners(port: int) -> list[tuple[str, str]]:
    """(file, local address in /proc hex) of every socket listening on ``port`` (state 0A)."""
    found = []
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            addr, hexport = fields[1].split(":")
            if int(hexport, 16) == port and fields[3] == "0A":
                found.append((name, addr))
    return found


# ---- 1. the store listens on loopback only ---------------------------------------------------------
@pytest.mark.parametrize("transport", ["shm", "gloo"])
async def test_trainer_store_listens_on_loopback_only(proc_engine, states, transport):
    before = await greedy(proc_engine)
    sync = await connect(proc_engine, transport)
    try:
        spec = sync.sender.spec_options()
        assert spec["host"] == "127.0.0.1"
        found = listeners(int(spec["port"]))
        assert found, f"nothing listens on the store's port {spec['port']}"
        # 0100007F is 127.0.0.1; never 00000000 (0.0.0.0) nor an IPv6 wildcard [::].
        assert found == [("tcp", "0100007F")] * len(found), found
        await honest_round_trip(proc_engine, sync, states, before)
    finally:
        await asyncio.wait_for(sync.close(), WAIT)


# ---- 2. forged store values ------------------------------------------------------------------------
async def test_forged_bucket_description_during_a_real_shm_push_is_refused(proc_engine, states):
    """The attacker learns the update's token and publishes its own bucket 0 (a shared-memory
    segment of its own, with a checksum that matches it) in the update's log."""
    before = await greedy(proc_engine)
    version = proc_engine.weight_version
    sync = await connect(proc_engine, "shm")
    evil: list[shared_memory.SharedMemory] = []
    try:
        sender = sync.sender
        attacker = attacker_store(int(sender.spec_options()["port"]))
        # The session's keys, as the session itself spells them (a PrefixStore joins with "/").
        keys = dist.PrefixStore(f"roe/{sender.session_id}/", attacker)
        honest_begin = sender.begin

        def begin(manifest: WeightManifest) -> None:
            honest_begin(manifest)
            nbytes = manifest.buckets[0].nbytes
            seg = shared_memory.SharedMemory(create=True, size=nbytes)
            evil.append(seg)
            data = torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes)
            data.fill_(7)
            line = json.dumps({"index": 0, "nbytes": nbytes, "checksum": checksum(data), "status": 0,
                               "reason": "", "slot": seg.name, "ack": False})
            del data
            keys.append(f"{manifest.session_id}/log", b"0" * 32 + b"|" + line.encode() + b"\n")

        sender.begin = begin  # type: ignore[method-assign]
        pushing = asyncio.ensure_future(push(sync, states["new"], version + 1))
        await innocent(proc_engine, 1)
        with pytest.raises(WeightSyncError, match="is not signed with this weight sync's key") as info:
            await pushing
        assert "engine 0" in str(info.value)
        del sender.begin  # the attacker stops
        assert await greedy(proc_engine) == before
        assert proc_engine.weight_version == version
        assert (await proc_engine.info()).weight_version == version
        await honest_round_trip(proc_engine, sync, states, before)
    finally:
        await asyncio.wait_for(sync.close(), WAIT)
        for seg in evil:
            seg.close()
            seg.unlink()


def _forge(attacker: dist.TCPStore, session_id: str, token: str, transport: str, forgery: str) -> None:
    raw = dist.PrefixStore(f"roe/{session_id}/", attacker)
    wrong = SignedStore(attacker, session_id, secrets.token_hex(32))  # a guessed secret
    line = json.dumps({"index": 0, "nbytes": 1, "checksum": 0, "status": 0, "reason": "", "slot": "x", "ack": False})
    abort = f"abort/{token}" if transport == "gloo" else f"{token}/abort"
    if forgery == "log-unsigned":
        raw.append(f"{token}/log", line.encode() + b"\n")
    elif forgery == "log-wrong-secret":
        wrong.append_line(f"{token}/log", line)
    elif forgery == "abort-unsigned":
        raw.set(abort, "forged abort")
    elif forgery == "abort-wrong-secret":
        wrong.set(abort, "forged abort")
    elif forgery == "update-unsigned":  # gloo: which group generation this update uses
        raw.set(f"update/{token}", "7")
    elif forgery == "update-wrong-secret":
        wrong.set(f"update/{token}", "7")
    else:
        raise AssertionError(forgery)


@pytest.mark.parametrize(
    ("transport", "forgery"),
    [
        ("shm", "log-unsigned"),
        ("shm", "log-wrong-secret"),
        ("shm", "abort-unsigned"),
        ("shm", "abort-wrong-secret"),
        ("gloo", "update-unsigned"),
        ("gloo", "update-wrong-secret"),
        ("gloo", "abort-unsigned"),
    ],
)
async def test_forged_store_value_is_refused_by_the_receiver(proc_engine, states, transport, forgery):
    """A manifest reached the engine; before the trainer sends anything the attacker writes the
    update's keys. The receiver refuses them; the engine keeps its weights; the session still works."""
    before = await greedy(proc_engine)
    version = proc_engine.weight_version
    sync = await connect(proc_engine, transport)
    try:
        attacker = attacker_store(int(sync.sender.spec_options()["port"]))
        manifest = manifest_for(states, version + 1, transport)
        receiving = asyncio.ensure_future(proc_engine.receive_weights(manifest))
        assert await innocent(proc_engine, 2) == [before, before]  # served while the manifest waits
        assert not receiving.done()
        _forge(attacker, sync.sender.session_id, manifest.session_id, transport, forgery)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="is not signed with this weight sync's key"):
            await asyncio.wait_for(receiving, WAIT)
        assert time.monotonic() - start < 5
        assert await greedy(proc_engine) == before
        assert proc_engine.weight_version == version
        await honest_round_trip(proc_engine, sync, states, before)
    finally:
        await asyncio.wait_for(sync.close(), WAIT)


# ---- 3. no pickle on the weight-sync path ---------------------------------------------------------
def test_weight_sync_code_never_unpickles():
    root = Path(rollout_engines.__file__).parent / "weights"
    files = sorted(root.rglob("*.py"))
    assert len(files) > 5
    bad: list[str] = []
    unsafe_modules = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(root)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad += [f"{where}:{node.lineno} import {a.name}" for a in node.names
                        if a.name.split(".")[0] in unsafe_modules]
            elif isinstance(node, ast.ImportFrom):
                if (node.module or "").split(".")[0] in unsafe_modules:
                    bad.append(f"{where}:{node.lineno} from {node.module} import ...")
                if node.module == "multiprocessing" and any(a.name == "reduction" for a in node.names):
                    bad.append(f"{where}:{node.lineno} multiprocessing.reduction")
            elif isinstance(node, ast.Name) and node.id in unsafe_modules:
                bad.append(f"{where}:{node.lineno} uses {node.id}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                func = ast.unparse(node.func)
                kwargs = {k.arg: k.value for k in node.keywords}
                if func in ("torch.load", "torch.serialization.load"):
                    wo = kwargs.get("weights_only")
                    if not (isinstance(wo, ast.Constant) and wo.value is True):
                        bad.append(f"{where}:{node.lineno} {func} without weights_only=True")
                if node.func.attr == "load" and func.split(".")[0] in ("np", "numpy"):
                    ap = kwargs.get("allow_pickle")
                    if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                        bad.append(f"{where}:{node.lineno} {func} with allow_pickle")
                if node.func.attr in ("loads", "load") and func.split(".")[0] in unsafe_modules:
                    bad.append(f"{where}:{node.lineno} {func}")
    assert not bad, "unpickling on the weight-sync path:\n" + "\n".join(bad)


# ---- 4. a push that misses a tensor ----------------------------------------------------------------
async def test_push_missing_a_tensor_is_refused_unless_partial(proc_engine, states):
    before = await greedy(proc_engine)
    version = proc_engine.weight_version
    sync = await connect(proc_engine, "shm")
    try:
        short = {k: v for k, v in states["new"].items() if k != MISSING}
        assert len(short) == len(states["new"]) - 1
        pushing = asyncio.ensure_future(push(sync, short, version + 1))
        await innocent(proc_engine, 1)
        with pytest.raises(ManifestMismatch) as info:
            await pushing
        assert not isinstance(info.value, StaleVersion)
        assert MISSING in str(info.value) and "partial=True" in str(info.value)
        assert await greedy(proc_engine) == before
        assert proc_engine.weight_version == version
        # On purpose: applied.
        assert await push(sync, short, version + 1, partial=True) == version + 1
        partial_out = await greedy(proc_engine)
        assert partial_out != before
        assert proc_engine.weight_version == version + 1
        # The next complete push works.
        await push(sync, states["orig"], version + 2)
        assert await greedy(proc_engine) == before
    finally:
        await asyncio.wait_for(sync.close(), WAIT)


# ---- 5. versions going backwards -------------------------------------------------------------------
async def test_version_going_backwards_is_refused_unless_rollback(proc_engine, states):
    before = await greedy(proc_engine)
    base = proc_engine.weight_version
    sync = await connect(proc_engine, "shm")
    try:
        await push(sync, states["new"], base + 3)
        after_v3 = await greedy(proc_engine)
        assert after_v3 != before
        with pytest.raises(StaleVersion):  # the trainer's own check
            await push(sync, states["orig"], base + 2)
        with pytest.raises(StaleVersion):  # equal is not newer either
            await push(sync, states["orig"], base + 3)
        assert await greedy(proc_engine) == after_v3
        # A trainer with a stale view of the engine: the engine itself refuses, in its own process.
        manifest = manifest_for(states, base + 2, "shm")
        proxy_view, proc_engine.weight_version = proc_engine.weight_version, 0
        try:
            with pytest.raises(StaleVersion, match=f"serves v{base + 3}"):
                await asyncio.wait_for(proc_engine.receive_weights(manifest), WAIT)
        finally:
            proc_engine.weight_version = proxy_view
        assert await greedy(proc_engine) == after_v3
        assert (await proc_engine.info()).weight_version == base + 3
        # On purpose: applied.
        assert await push(sync, states["orig"], base + 2, allow_rollback=True) == base + 2
        assert await greedy(proc_engine) == before
        assert (await proc_engine.info()).weight_version == base + 2
        # Forward again from there (the next version above the engine's).
        await honest_round_trip(proc_engine, sync, states, before)
    finally:
        await asyncio.wait_for(sync.close(), WAIT)


# ---- 6. malformed manifests ------------------------------------------------------------------------
def _bad_layouts(good: WeightManifest) -> dict[str, dict]:
    """Manifest documents (what crosses a process hop or the network) broken one way each."""
    base = good.model_dump()
    multi = next(b for b in base["buckets"] if len(b["tensors"]) >= 2)
    t0, t1 = multi["tensors"][0], multi["tensors"][1]
    out: dict[str, dict] = {}

    def variant(name: str):  # type: ignore[no-untyped-def]
        doc = json.loads(json.dumps(base))
        out[name] = doc
        return doc, next(b for b in doc["buckets"] if b["index"] == multi["index"])

    doc, bucket = variant("negative index")
    bucket["tensors"] = [-1, *bucket["tensors"][1:]]
    doc, bucket = variant("index out of range")
    bucket["tensors"] = [*bucket["tensors"], len(doc["tensors"])]
    doc, bucket = variant("tensor in no bucket")
    bucket["tensors"] = bucket["tensors"][1:]
    doc, bucket = variant("tensor in two buckets")
    other = next(b for b in doc["buckets"] if b["index"] != multi["index"])
    other["tensors"] = [*other["tensors"], t0]
    doc, _ = variant("overlapping offsets")
    doc["tensors"][t1]["offset"] = doc["tensors"][t0]["offset"]
    doc, _ = variant("tensor past the bucket end")
    doc["tensors"][t1]["offset"] = multi["nbytes"]
    doc, _ = variant("duplicate names")
    doc["tensors"][t1]["name"] = doc["tensors"][t0]["name"]
    doc, _ = variant("negative offset")
    doc["tensors"][t1]["offset"] = -256
    doc, _ = variant("buckets out of order")
    doc["buckets"] = list(reversed(doc["buckets"]))
    return out


def test_malformed_manifests_are_rejected_when_built(states):
    good = manifest_for(states, 1, "shm")
    for what, doc in _bad_layouts(good).items():
        with pytest.raises(ValidationError):
            WeightManifest.model_validate(doc)
            pytest.fail(f"accepted a manifest with {what}")
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        BucketSpec(index=-1, nbytes=1, tensors=())
    named = list(states["new"].items())
    dup = [*named, named[3]]
    with pytest.raises(ManifestMismatch, match="more than once"):
        plan_manifest(specs_of(dup), version=1, bucket_bytes=BUCKET)


def _unchecked(doc: dict) -> WeightManifest:
    """A manifest object that skipped validation, as a buggy or hostile trainer could send."""
    from rollout_engines.weights.manifest import TensorPlacement

    return WeightManifest.model_construct(
        **{**doc, "tensors": [TensorPlacement.model_construct(**{**t, "shape": tuple(t["shape"])})
                              for t in doc["tensors"]],
           "buckets": [BucketSpec.model_construct(**{**b, "tensors": tuple(b["tensors"])}) for b in doc["buckets"]]}
    )


async def test_malformed_manifests_change_nothing_in_the_engine(proc_engine, states):
    before = await greedy(proc_engine)
    version = proc_engine.weight_version
    sync = await connect(proc_engine, "shm")
    try:
        good = manifest_for(states, version + 1, "shm")
        for what, doc in _bad_layouts(good).items():
            with pytest.raises((ValidationError, ManifestMismatch, RuntimeError)) as info:
                await asyncio.wait_for(proc_engine.receive_weights(_unchecked(doc)), WAIT)
            text = f"{type(info.value).__name__}: {info.value}"
            assert "ValidationError" in text or isinstance(info.value, ManifestMismatch), (what, text)
            assert await greedy(proc_engine) == before, what
            assert proc_engine.weight_version == version
        # Duplicate names from the trainer: refused before anything is sent.
        named = list(states["new"].items())
        with pytest.raises(ManifestMismatch, match="more than once"):
            await push(sync, [*named, named[5]], version + 1)
        with pytest.raises(ManifestMismatch, match="more than once"):
            await push(sync, [*named, (named[5][0], named[5][1] * 0)], version + 1)
        assert await greedy(proc_engine) == before
        assert (await proc_engine.info()).weight_version == version
        await honest_round_trip(proc_engine, sync, states, before)
    finally:
        await asyncio.wait_for(sync.close(), WAIT)


# ---- 7. a manifest followed by no buckets ----------------------------------------------------------
@pytest.mark.parametrize(
    ("transport", "how"),
    [("shm", "close"), ("shm", "reconnect"), ("gloo", "close"), ("gloo", "reconnect"), ("disk", "close"),
     ("inproc", "close")],
)
async def test_manifest_without_buckets_is_cancelled_and_changes_nothing(local_engine, states, transport, how):
    engine = local_engine
    before = await greedy(engine)
    sync = await connect(engine, transport)
    sync2 = None
    try:
        manifest = manifest_for(states, 1, transport)
        receiving = asyncio.ensure_future(engine.receive_weights(manifest))
        await asyncio.sleep(0.3)
        # Generation goes on while the manifest waits for buckets that never come.
        assert await innocent(engine, 3) == [before] * 3
        assert not receiving.done()
        update = (await engine.info()).extra.get("weight_update")
        assert update is not None, "info() does not show the update in progress"
        assert update["version"] == 1 and update["timeout_s"] == TIMEOUT
        assert update["seconds"] > 0 and update["stuck"] is False
        assert await engine.health()
        start = time.monotonic()
        if how == "close":
            await asyncio.wait_for(engine.close_weight_transfer(), WAIT)
        else:
            sync2 = await connect(engine, transport)
        with pytest.raises(WeightSyncError):
            await asyncio.wait_for(receiving, WAIT)
        elapsed = time.monotonic() - start
        assert elapsed < 5, f"cancelling the receive took {elapsed:.1f} s (the session timeout is {TIMEOUT:.0f} s)"
        assert "weight_update" not in (await engine.info()).extra
        assert await greedy(engine) == before
        assert engine.weight_version == 0
        if sync2 is not None:  # the new session works
            await push(sync2, states["new"], 1)
            assert await greedy(engine) != before
            await push(sync2, states["orig"], 2)
            assert await greedy(engine) == before
    finally:
        for s in (sync, sync2):
            if s is not None:
                await asyncio.wait_for(s.close(), WAIT)


# ---- 8. a transport the engine does not declare ----------------------------------------------------
@pytest.mark.parametrize("transport", ["nccl", "cuda_ipc", "evil-transport"])
async def test_undeclared_transport_is_refused_at_once(local_engine, proc_engine, transport):
    for engine in (local_engine, proc_engine):
        before = await greedy(engine)
        assert transport not in engine.capabilities.transports
        start = time.monotonic()
        with pytest.raises(CapabilityError, match=f"cannot receive weights over '{transport}'"):
            await asyncio.wait_for(connect_weight_sync([engine], transport, timeout_s=TIMEOUT), 5)
        with pytest.raises(CapabilityError):
            await asyncio.wait_for(engine.init_weight_transfer(
                TransportSpec(transport=transport, session_id="x" * 16, timeout_s=TIMEOUT)), 5)
        assert time.monotonic() - start < 2.0
        assert await greedy(engine) == before


# ---- 9. a timeout above the ceiling ----------------------------------------------------------------
async def test_timeout_above_the_ceiling_is_refused(proc_engine, states):
    huge = MAX_TIMEOUT_S * 10
    with pytest.raises(ValueError, match="ROLLOUT_ENGINES_MAX_TIMEOUT_S"):
        check_timeout(huge)
    with pytest.raises(ValidationError, match="ROLLOUT_ENGINES_MAX_TIMEOUT_S"):
        TransportSpec(transport="shm", session_id="s" * 16, timeout_s=huge)
    with pytest.raises(ValidationError, match="ROLLOUT_ENGINES_MAX_TIMEOUT_S"):
        plan_manifest(specs_of(list(states["new"].items())), version=1, timeout_s=huge)
    with pytest.raises(ValueError, match="ROLLOUT_ENGINES_MAX_TIMEOUT_S"):
        await asyncio.wait_for(connect_weight_sync([proc_engine], "shm", timeout_s=huge), 5)
    # A spec or manifest that skipped validation in the trainer is checked again by the engine.
    spec = TransportSpec.model_construct(transport="shm", session_id="s" * 16, rank_offset=1, world_size=2,
                                         timeout_s=huge, options={})
    with pytest.raises((ValidationError, RuntimeError, ManifestMismatch), match="ROLLOUT_ENGINES_MAX_TIMEOUT_S"):
        await asyncio.wait_for(proc_engine.init_weight_transfer(spec), WAIT)
    good = manifest_for(states, proc_engine.weight_version + 1, "shm")
    slow = _unchecked({**good.model_dump(), "timeout_s": huge})
    with pytest.raises((ValidationError, RuntimeError, ManifestMismatch), match="ROLLOUT_ENGINES_MAX_TIMEOUT_S"):
        await asyncio.wait_for(proc_engine.receive_weights(slow), WAIT)
    assert await proc_engine.health()
    await innocent(proc_engine, 1)


def test_timeout_ceiling_follows_the_environment():
    code = (
        "from rollout_engines.weights.manifest import check_timeout, MAX_TIMEOUT_S\n"
        "assert MAX_TIMEOUT_S == 5.0, MAX_TIMEOUT_S\n"
        "check_timeout(4)\n"
        "try:\n    check_timeout(6)\nexcept ValueError as e:\n    print('REFUSED', e)\n"
    )
    env = {**os.environ, "ROLLOUT_ENGINES_MAX_TIMEOUT_S": "5"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "REFUSED" in out.stdout and "ROLLOUT_ENGINES_MAX_TIMEOUT_S" in out.stdout


# ---- 10. swapped same-size tensors in a bucket -----------------------------------------------------
def _swap_pair(manifest: WeightManifest, tensors: dict[str, torch.Tensor]) -> tuple[int, int, int, int]:
    """(bucket, offset a, offset b, nbytes) of two same-size, different tensors packed in one bucket."""
    for bucket in manifest.buckets:
        placed = manifest.bucket_tensors(bucket.index)
        for i, a in enumerate(placed):
            for b in placed[i + 1:]:
                if a.nbytes == b.nbytes and a.nbytes >= 1024 and not torch.equal(tensors[a.name], tensors[b.name]):
                    return bucket.index, a.offset, b.offset, a.nbytes
    raise AssertionError("no two same-size tensors share a bucket")


def _swap(buf: torch.Tensor, a: int, b: int, n: int) -> None:
    first = buf[a:a + n].clone()
    buf[a:a + n].copy_(buf[b:b + n])
    buf[b:b + n].copy_(first)


def test_pos64_sees_swapped_tensors_that_sum64_does_not(states):
    from rollout_engines.weights.buckets import alloc_bucket, pack_bucket

    manifest = manifest_for(states, 1, "shm")
    index, a, b, n = _swap_pair(manifest, states["new"])
    buf = pack_bucket(manifest, index, dict(states["new"]), alloc_bucket(manifest.buckets[index].nbytes, "cpu"))
    sums = (checksum(buf, "pos64"), checksum(buf, "sum64"))
    _swap(buf, a, b, n)
    assert checksum(buf, "sum64") == sums[1]  # why the default is pos64
    assert checksum(buf, "pos64") != sums[0]


async def test_swapped_tensors_in_a_shared_memory_bucket_are_detected(proc_engine, states):
    """Someone on the host with access to the shared-memory segment swaps two same-size tensors in
    a packed bucket after the trainer computed its checksum."""
    before = await greedy(proc_engine)
    version = proc_engine.weight_version
    sync = await connect(proc_engine, "shm")
    assert sync.checksum == "pos64"  # the default
    try:
        sender = sync.sender
        target = _swap_pair(manifest_for(states, version + 1, "shm"), states["new"])
        honest_send = sender.send_bucket
        tampered: list[int] = []

        def send_bucket(header, buf):  # type: ignore[no-untyped-def]
            index, a, b, n = target
            if header.index == index:
                _swap(buf, a, b, n)  # the slot in shared memory the receiver maps
                tampered.append(index)
            honest_send(header, buf)

        sender.send_bucket = send_bucket  # type: ignore[method-assign]
        pushing = asyncio.ensure_future(push(sync, states["new"], version + 1))
        await innocent(proc_engine, 1)
        with pytest.raises(WeightSyncError, match="checksum mismatch"):
            await pushing
        assert tampered == [target[0]]
        del sender.send_bucket
        assert await greedy(proc_engine) == before
        assert (await proc_engine.info()).weight_version == version
        await honest_round_trip(proc_engine, sync, states, before)
    finally:
        await asyncio.wait_for(sync.close(), WAIT)
