"""Every proxy forwards every public method of the engine protocol, with one error wire format.

Four hosts of a far engine, each real: a child process over a pipe (``ProcessEngine``), a Ray
actor on a local Ray cluster (``RayEngine``), a rollout-engines server over HTTP on 127.0.0.1
(the ``remote`` backend) and an in-process adapter channel (how the ``remote`` backend serves a
plain server's adapter). The far engine is :class:`recording_engine.RecordingEngine`, which
records the calls it receives; the record is read back through the proxy.

Two things are by design not one-to-one over HTTP: ``chat`` is the server's ``POST /generate``
with messages (the far engine sees ``generate``), and ``close`` closes the client's connections,
never the server's engine (the server outlives its clients).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from rollout_engines import (
    ChatMessage,
    EngineConfig,
    EngineProtocol,
    GenerateRequest,
    InvalidRequest,
    LoraSpec,
    ManifestMismatch,
    SamplingParams,
    StaleVersion,
    TensorSpec,
    TransportSpec,
    WeightsInvalidated,
    WeightSyncError,
)
from rollout_engines.errors import CapabilityError, EngineAsleep, EngineClosed
from rollout_engines.proxy import LocalChannel, ProxyEngine, WireError, raise_for_workers
from rollout_engines.weights.manifest import plan_manifest

pytestmark = pytest.mark.timeout(300)

FACTORY = "recording_engine:RecordingEngine"
TESTS_DIR = str(Path(__file__).resolve().parent)
API_KEY = "proxy-test-key"
SAMPLING = SamplingParams(temperature=0.0, max_tokens=3)
REQUEST = GenerateRequest(prompt_token_ids=[[5, 7]], sampling=SAMPLING)
#: A gloo session as the trainer names it (the recording engines join nothing; a server checks the address).
GLOO_SPEC = TransportSpec(transport="gloo", session_id="s1", options={"host": "127.0.0.1", "port": 29500})
CHAT = GenerateRequest(messages=[[ChatMessage(role="user", content="hi")]], sampling=SAMPLING)
KINDS = ("process", "ray", "remote", "adapter")


def manifest(version: int, session: str = "s1"):
    return plan_manifest([TensorSpec(name="w", dtype="float32", shape=(2, 2))], version=version,
                         transport="gloo").model_copy(update={"session_id": session})


def lora_manifest(version: int, name: str = "adapter-1"):
    spec = LoraSpec(name=name, rank=2, alpha=4.0, target_modules=["w"])
    tensors = [TensorSpec(name="base_model.model.w.lora_A.weight", dtype="float32", shape=(2, 2)),
               TensorSpec(name="base_model.model.w.lora_B.weight", dtype="float32", shape=(2, 2))]
    return plan_manifest(tensors, version=version, transport="gloo", lora=spec).model_copy(update={"session_id": "s1"})


def config(tmp_path: Path) -> EngineConfig:
    return EngineConfig(backend="recording", model="recording", options={"close_marker": str(tmp_path / "closed")})


# ---- the four hosts ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if not hasattr(ray, "init"):  # tests/ray/ seen as a namespace package: Ray itself is absent
        pytest.skip('Ray is not installed: pip install "rollout-engines[ray]"')
    # The actor imports the recording engine from this folder.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])}})
    yield ray
    ray.shutdown()


class _Server:
    """A rollout-engines server on 127.0.0.1 serving ``engine`` from a thread of this process."""

    def __init__(self, engine: Any) -> None:
        uvicorn = pytest.importorskip("uvicorn")
        from rollout_engines_remote.launch import free_port
        from rollout_engines_remote.server import create_app

        port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{port}"
        app = create_app(engine, api_key=API_KEY, bind_host="127.0.0.1")
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest_asyncio.fixture(params=KINDS)
async def proxy(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[str, EngineProtocol, Path]]:
    kind: str = request.param
    cfg = config(tmp_path)
    marker = tmp_path / "closed"
    server = far = None
    engine: EngineProtocol
    if kind == "process":
        from rollout_engines.process import ProcessEngine

        engine = await asyncio.to_thread(ProcessEngine, cfg, factory=FACTORY, start_timeout_s=120)
    elif kind == "ray":
        request.getfixturevalue("ray_cluster")
        from rollout_engines.ray import acreate_ray_engines

        engine = (await acreate_ray_engines(1, cfg, factory=FACTORY, num_cpus=1, start_timeout_s=120))[0]
    elif kind == "remote":
        pytest.importorskip("rollout_engines_remote")
        from recording_engine import RecordingEngine
        from rollout_engines_remote.client import RemoteEngine

        far = RecordingEngine(cfg)
        server = await asyncio.to_thread(_Server, far)
        engine = await asyncio.to_thread(RemoteEngine, EngineConfig(
            backend="remote", model=server.url, options={"api_key": API_KEY, "retries": 0}))
    else:
        from recording_engine import RecordingEngine

        channel = LocalChannel(RecordingEngine(cfg))
        engine = ProxyEngine(channel, cfg, channel.host.describe())
    try:
        yield kind, engine, marker
    finally:
        await engine.close()
        if server is not None:
            server.stop()
        if far is not None:
            await far.close()


# ---- what each method is asked, and what it must answer ----------------------------------------
async def _stream(engine: EngineProtocol) -> None:
    deltas = [d async for d in engine.stream(REQUEST)]
    assert [t for d in deltas for t in d.token_ids] == [7, 7, 7]
    assert deltas[-1].finish_reason == "length" and len({d.request_id for d in deltas}) == 1


async def _generate(engine: EngineProtocol) -> None:
    outs = await engine.generate(REQUEST)
    assert [c.token_ids for c in outs] == [[7, 7, 7]] and outs[0].request_id


async def _chat(engine: EngineProtocol) -> None:
    outs = await engine.chat(CHAT)
    assert [c.token_ids for c in outs] == [[1, 1, 1]]


async def _receive(engine: EngineProtocol) -> None:
    assert await engine.receive_weights(manifest(1)) == 1
    assert engine.weight_version == 1


async def _unload_lora(engine: EngineProtocol) -> None:
    base = engine.weight_version
    assert await engine.receive_weights(lora_manifest(3)) == 3  # a LoRA push: the adapter's version
    assert engine.weight_version == base and engine.loras == {"adapter-1": 3}
    assert (await engine.info()).loras == {"adapter-1": 3}
    assert await engine.unload_lora("adapter-1") is True
    assert engine.loras == {} and (await engine.info()).loras == {}
    assert await engine.unload_lora("adapter-1") is False


async def _health(engine: EngineProtocol) -> None:
    assert await engine.health() is True


async def _info(engine: EngineProtocol) -> None:
    info = await engine.info()
    assert info.backend == engine.backend_name and info.capabilities == engine.capabilities.model_dump()


async def _diagnostics(engine: EngineProtocol) -> None:
    diag = await engine.diagnostics()
    assert diag.backend == "recording" and diag.weight_version == engine.weight_version
    assert diag.last_reset_s is None and diag.weights_fingerprint is None


CALLS: dict[str, Callable[[EngineProtocol], Awaitable[None]]] = {
    "generate": _generate,
    "stream": _stream,
    "abort": lambda e: e.abort(["r-1"]),
    "abort_all": lambda e: e.abort_all(),
    "chat": _chat,
    "sleep": lambda e: e.sleep(1),
    "wake_up": lambda e: e.wake_up(),
    "reset_prefix_cache": lambda e: e.reset_prefix_cache(),
    "pause": lambda e: e.pause("keep"),
    "resume": lambda e: e.resume(),
    "init_weight_transfer": lambda e: e.init_weight_transfer(GLOO_SPEC),
    "receive_weights": _receive,
    "close_weight_transfer": lambda e: e.close_weight_transfer(),
    "unload_lora": _unload_lora,
    "info": _info,
    "health": _health,
    "diagnostics": _diagnostics,
    "close": lambda e: e.close(),
}
#: Over HTTP, the far engine sees these instead (see the module docstring).
HTTP_FAR_NAME = {"chat": "generate", "close": None}


def test_the_table_covers_the_protocol():
    assert tuple(CALLS) == EngineProtocol.methods()


async def far_calls(engine: EngineProtocol) -> list[str]:
    calls = list((await engine.info()).extra["calls"])
    assert calls[-1] == "info"
    return calls[:-1]


async def test_every_proxy_forwards_every_public_method(proxy):
    kind, engine, marker = proxy
    assert isinstance(engine, EngineProtocol)
    assert engine.backend_name == ("remote" if kind == "remote" else "recording")
    caps = engine.capabilities
    assert caps.streaming and caps.abort and caps.multi_process and "gloo" in caps.transports  # fetched at connect
    for name in EngineProtocol.methods():
        before = len(await far_calls(engine))
        await CALLS[name](engine)
        if name == "close":
            break
        seen = (await far_calls(engine))[before:]
        far_name = HTTP_FAR_NAME.get(name, name) if kind == "remote" else name
        assert far_name in seen, f"{kind}: {name}() did not reach the far engine (it saw {seen})"
    if kind == "remote":
        assert not marker.exists(), "closing a remote client must not close the server's engine"
    else:
        assert marker.read_text() == "closed"  # the far engine was closed before its host went away
    assert engine.closed and await engine.health() is False
    with pytest.raises(EngineClosed):
        await engine.generate(REQUEST)


async def test_the_far_engine_keeps_the_rules_and_resets_its_cache_once(proxy):
    kind, engine, _ = proxy
    resets = (await engine.info()).extra["cache_resets"]
    await engine.sleep(1)
    with pytest.raises(EngineAsleep):  # checked by the far engine, raised here as itself
        await engine.generate(REQUEST)
    await engine.wake_up()
    await engine.init_weight_transfer(GLOO_SPEC)
    await engine.receive_weights(manifest(1))
    # One reset after the wake-up and one after the update: the far engine's rule, never repeated here.
    assert (await engine.info()).extra["cache_resets"] == resets + 2


async def test_errors_cross_as_the_same_types(proxy):
    kind, engine, _ = proxy
    await engine.init_weight_transfer(GLOO_SPEC)
    await engine.receive_weights(manifest(1))
    with pytest.raises(StaleVersion, match="versions must increase"):
        await engine.receive_weights(manifest(1))
    with pytest.raises(WeightSyncError, match="bad bucket") as refused:
        await engine.receive_weights(manifest(2, session="refuse"))
    if kind != "remote":  # the server's error body has no peer/bucket fields yet
        assert refused.value.peer == "trainer (rank 0)" and refused.value.bucket == 3
    with pytest.raises(CapabilityError, match="cuda_ipc"):
        await engine.init_weight_transfer(TransportSpec(transport="cuda_ipc", session_id="s2"))
    with pytest.raises(ValueError, match="unknown sleep tags"):
        await engine.sleep(1, ["gpu"])
    # A far-side pydantic ValidationError arrives typed: a request -> InvalidRequest, a manifest
    # -> ManifestMismatch. (Sent raw through the channel: this side's models would refuse them.)
    channel = engine.channel  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequest):
        await channel.call("generate", {"request": {"prompt_token_ids": []}}, 30)
    if kind != "remote":
        with pytest.raises(ManifestMismatch):
            await channel.call("receive_weights", {"manifest": {"version": "not a number"}}, 30)


async def test_a_stream_stopped_early_ends_on_the_far_side(proxy):
    kind, engine, _ = proxy
    if kind == "remote":
        pytest.skip("the server ends a stream when its client disconnects; covered by the server's tests")
    long = GenerateRequest(prompt_token_ids=[[5]], sampling=SamplingParams(max_tokens=500))
    got = []
    async for delta in engine.stream(long):
        got.append(delta)
        if len(got) == 2:
            break
    for _ in range(100):
        if (await engine.info()).outstanding == 0:
            break
        await asyncio.sleep(0.05)
    assert (await engine.info()).outstanding == 0


async def test_a_stream_cancelled_while_it_opens_ends_on_the_far_side(tmp_path):
    from rollout_engines.process import ProcessEngine

    engine = await asyncio.to_thread(ProcessEngine, config(tmp_path), factory=FACTORY, start_timeout_s=120)
    try:
        long = GenerateRequest(prompt_token_ids=[[5]], sampling=SamplingParams(max_tokens=500))

        async def consume() -> None:
            async for _ in engine.stream(long):
                pass

        task = asyncio.ensure_future(consume())
        deadline = time.monotonic() + 10
        while not engine.pipe._pending:  # _stream_open is on its way to the child
            assert time.monotonic() < deadline
            await asyncio.sleep(0)
        task.cancel()  # e.g. the caller's asyncio.wait_for ran out
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(engine.pause("wait"), 10)  # returns once the far stream has ended
        assert (await engine.info()).outstanding == 0
    finally:
        await engine.close()


async def test_a_far_stream_closed_before_it_opens_or_not_polled_ends():
    from recording_engine import RecordingEngine
    from rollout_engines.proxy import SIGNATURES, EngineHost

    far = RecordingEngine(EngineConfig(backend="recording", model="recording"))
    host = EngineHost(far, stream_idle_s=0.2)
    wire = SIGNATURES["stream"].params["request"].encode(
        GenerateRequest(prompt_token_ids=[[5]], sampling=SamplingParams(max_tokens=500)))
    try:
        await host.call("_stream_close", {"sid": "early"})  # the close overtook its open
        with pytest.raises(EngineClosed):
            await host.call("_stream_open", {"request": wire, "sid": "early"})
        await host.call("_stream_open", {"request": wire, "sid": "lost"})
        assert (await host.call("_stream_next", {"sid": "lost"}))["items"]
        assert (await far.info()).outstanding == 1  # its caller vanished without closing it
        deadline = time.monotonic() + 10
        while (await far.info()).outstanding:
            assert time.monotonic() < deadline, "a stream nobody polls was never ended"
            await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="no open stream"):
            await host.call("_stream_next", {"sid": "lost"})
    finally:
        await far.close()


# ---- the one partial-failure rule (worker results as the vLLM worker extension sends them) -------
OK = {"ok": True, "version": 3}
LOST = {"ok": False, "error": "WeightSyncError", "message": "gloo: no bucket within 60 s; peer: trainer (rank 0); bucket: 2",
        "peer": "trainer (rank 0)", "bucket": 2}
MISMATCH = {"ok": False, **WireError.of(ManifestMismatch("unknown tensor 'x'")).model_dump()}
CRASH = {"ok": False, **WireError.of(RuntimeError("boom")).model_dump()}


def _raised(results, **kw) -> WeightSyncError:
    with pytest.raises(WeightSyncError) as info:
        raise_for_workers(results, "weight update v3", **kw)
    return info.value


def test_partial_worker_failures_follow_one_rule():
    raise_for_workers([OK, OK], "weight update v3", applies_weights=True)
    lost = _raised([LOST], applies_weights=True)
    assert type(lost) is WeightSyncError and (lost.peer, lost.bucket) == ("trainer (rank 0)", 2)
    assert str(lost).count("peer:") == 1
    half = _raised([OK, LOST], applies_weights=True)  # one worker applied it, one did not
    assert isinstance(half, WeightsInvalidated) and "workers [0] applied it" in str(half) and half.bucket == 2
    assert type(_raised([OK, LOST], applies_weights=False)) is WeightSyncError  # a failed join changes nothing
    assert type(_raised([OK, MISMATCH], applies_weights=True)) is ManifestMismatch  # checked before applying
    assert "worker 1: RuntimeError: boom" in str(_raised([OK, CRASH], applies_weights=True, worker="worker"))


def test_wire_errors_rebuild_ours_builtins_and_validation_errors():
    from pydantic import ValidationError
    from rollout_engines.proxy import FarEngineError
    from rollout_engines.weights.manifest import WeightManifest

    assert type(WireError.of(StaleVersion("old")).to_exception()) is StaleVersion
    assert type(WireError.of(KeyError("k")).to_exception()) is KeyError
    with pytest.raises(ValidationError) as bad_manifest:
        WeightManifest.model_validate({"version": "x"})
    assert type(WireError.of(bad_manifest.value).to_exception()) is ManifestMismatch
    with pytest.raises(ValidationError) as bad_request:
        GenerateRequest(prompt_token_ids=[])
    assert type(WireError.of(bad_request.value).to_exception()) is InvalidRequest

    class Odd(Exception):
        pass

    far = WireError.of(Odd("x")).to_exception("the far engine")
    assert isinstance(far, FarEngineError) and far.far_type == "Odd" and "Odd: x" in str(far)
