"""``cuda_ipc`` on a real GPU: a receiver process opens the trainer's bucket buffers by device UUID."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp

import pytest
import torch
from rollout_engines.weights.manifest import TransportSpec, manifest_to_wire

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


class ForwardingTarget:
    """A target that takes every even bucket the sender shared without packing through
    ``apply_shared`` (as SGLang's relay forwards them), recording what it got, and leaves the odd
    ones to ``apply``."""

    def __init__(self, inner) -> None:
        self.inner, self.forwarded = inner, []

    def expected_specs(self):
        return self.inner.expected_specs()

    def apply(self, named, *, owned):
        self.inner.apply(named, owned=owned)

    def apply_shared(self, index, placements, shared):
        import json

        from rollout_engines.weights.transports.cuda_ipc import device_uuid

        if index % 2:
            return False
        desc = json.loads(shared.description)
        assert len(desc["refs"]) == len(placements) == len(shared)
        assert shared.device_uuid == device_uuid(torch.device("cuda:0"))
        self.forwarded.append(index)
        self.inner.apply([(p.name, t) for p, t in zip(placements, shared, strict=True)], owned=False)
        return True


def receiver_main(conn, spec: dict, shapes: dict, forward: bool = False) -> None:
    from rollout_engines.weights.manifest import manifest_from_wire
    from rollout_engines.weights.receiver import WeightReceiver

    class Params(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, shape in shapes.items():
                self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, device="cuda:0")))

    from rollout_engines.weights.receiver import StateDictTarget

    module = Params()
    target = ForwardingTarget(StateDictTarget(module)) if forward else StateDictTarget(module)
    receiver = WeightReceiver(target, device="cuda:0", mode="inplace")
    receiver.connect(TransportSpec(**spec))
    conn.send("connected")
    while True:
        manifest = conn.recv()
        if manifest is None:
            break
        receiver.receive(manifest_from_wire(manifest))
        sums = {n: float(p.double().sum()) for n, p in module.named_parameters()}
        conn.send((sums, receiver.transport.opened if not forward else target.forwarded))
    receiver.close()


@contextlib.asynccontextmanager
async def receiver_process(state: dict, options: dict, forward: bool = False):
    """A sender in this process and a receiver process holding parameters shaped like ``state``;
    yields ``push(named, version) -> (parameter sums there, IPC handles it opened so far)``."""
    from rollout_engines.plugins import get_registry
    from rollout_engines.weights.session import WeightSync

    cls = get_registry().transport("cuda_ipc").load_sender()
    sender = cls(session_id="ipc-test", world_size=2, timeout_s=60, options=options)
    spec = TransportSpec(transport="cuda_ipc", session_id="ipc-test", world_size=2, timeout_s=60,
                         options=sender.spec_options())
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    proc = ctx.Process(target=receiver_main, args=(child, spec.model_dump(), shapes, forward))
    proc.start()
    try:
        sender.connect()
        assert await asyncio.to_thread(conn.recv) == "connected"
        sync = WeightSync([], sender, transport="cuda_ipc", bucket_bytes=4 * 2**20, timeout_s=60,
                          checksum="sum64", progress=False)

        async def push(named: dict, version: int):
            # As WeightSync.push and an engine's RPC do: the layout of the last push is reused, so
            # both ends keep what they built for it (e.g. their views of the slots).
            manifest, items = sync._manifest(list(named.items()), None, version)
            conn.send(manifest_to_wire(manifest))
            await asyncio.to_thread(sync._stream, manifest, iter(items))
            sums, opened = await asyncio.to_thread(conn.recv)
            for n, t in named.items():
                assert sums[n] == pytest.approx(float(t.double().sum()), rel=1e-6, abs=1e-3)
            return manifest, opened

        push.sender = sender  # type: ignore[attr-defined]
        yield push
        conn.send(None)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        sender.close()


async def test_cuda_ipc_push_lands_whole_and_opens_each_slot_once():
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(256, 1024, device="cuda:0") for i in range(40)}  # 40 MiB
    async with receiver_process(state, {"direct": False}) as push:
        # From the second push on, both ends copy through the views they kept of the two slots
        # and the receiver replays its copies from a CUDA graph: every value lands.
        for version, scale in ((1, 1.0), (2, -2.0), (3, 0.5), (4, 3.0)):
            manifest, opened = await push({n: t * scale for n, t in state.items()}, version)
            assert len(manifest.buckets) == 10
            assert opened == 2  # two slots, each opened once, across 40 buckets and 4 updates


def _rebuild_patched_in_the_trainer_only(*args):  # what a receiver process could not import
    raise AssertionError("the receiver must rebuild with torch's own function")


async def test_slot_handles_travel_without_a_patched_rebuild_function(monkeypatch):
    """A library in the trainer's process may patch torch's CUDA reductions (SGLang does, with a
    rebuild function the receiver process cannot import: seen on the H200 when SGLang had run in
    the same pytest process). Only the handle's arguments travel."""
    from torch.multiprocessing import reductions

    original = reductions.reduce_tensor
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (_rebuild_patched_in_the_trainer_only, original(t)[1]))
    state = {f"w{i}": torch.randn(256, 1024, device="cuda:0") for i in range(8)}
    async with receiver_process(state, {"direct": False}) as push:
        _, opened = await push(state, 1)
        assert opened == 2


async def test_zero_copy_push_reads_the_trainers_tensors_and_keeps_only_live_segments_mapped():
    """Direct (zero-copy) buckets: right values; tensors the trainer keeps (the same dict pushed
    again) stay mapped, so later pushes open nothing; temporaries are unmapped after each push;
    the sender's tensors changing between pushes is seen by the next push."""
    from rollout_engines.weights.transports import _cuda_segments

    if not _cuda_segments.available():
        pytest.skip("zero-copy cuda_ipc needs cuda-bindings")
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(256, 1024, device="cuda:0") for i in range(40)}  # 40 MiB
    async with receiver_process(state, {}) as push:
        opened_after = []
        for version in range(1, 6):
            if version == 4:
                for t in state.values():
                    t.mul_(-0.5)  # the trainer's step: in place, as an optimizer does
            named = state if version != 5 else {n: t * 3 for n, t in state.items()}  # 5: temporaries
            opened_after.append((await push(named, version))[1])
        assert push.sender._exporter.failed is None
        assert opened_after[0] >= 1  # no slot: the trainer's own segments
        assert opened_after[2] == opened_after[1] == opened_after[3]  # kept mapped: nothing reopened
        assert opened_after[4] > opened_after[3]  # temporaries live in other memory


async def test_two_kept_weight_sets_pushed_in_turn_reuse_their_descriptions():
    """A trainer alternating between two weight sets it keeps (as ``bench push`` does): once both
    are known to be kept, each bucket goes out under the description made for its set (no re-describing,
    the receiver finds its views, and so its copy graphs, again); nothing is reopened; every
    push lands."""
    from rollout_engines.weights.transports import _cuda_segments

    if not _cuda_segments.available():
        pytest.skip("zero-copy cuda_ipc needs cuda-bindings")
    torch.manual_seed(0)
    sets = [{f"w{i}": torch.randn(256, 1024, device="cuda:0") * (k + 1) for i in range(16)} for k in range(2)]
    async with receiver_process(sets[0], {}) as push:
        sent: list[list[int]] = []
        send_shared = push.sender.send_shared

        def spy(header, shared, tensors):
            sent[-1].append(id(shared))
            return send_shared(header, shared, tensors)

        push.sender.send_shared = spy
        opened = []
        for version in range(1, 7):
            sent.append([])
            opened.append((await push(sets[version % 2], version))[1])
        # Pushes 1 and 2 learn that the trainer keeps the sets (they come back); 3 and 4 describe
        # them as kept; 5 and 6 send those descriptions again.
        assert sent[4] == sent[2] and sent[5] == sent[3] and sent[2] != sent[3]
        assert opened[3] == opened[5]  # both sets' segments stay mapped


async def test_a_target_may_take_shared_buckets_by_their_description():
    """``WeightTarget.apply_shared``: a bucket of the trainer's own tensors comes with the trainer's
    description of their memory (what a host forwards to another process); a target that takes
    it gets no ``apply`` for it, one that declines gets the views as before; every push lands
    (checked by the parameters' sums). Packed buckets (``direct: False``) never reach it."""
    from rollout_engines.weights.transports import _cuda_segments

    if not _cuda_segments.available():
        pytest.skip("zero-copy cuda_ipc needs cuda-bindings")
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(256, 1024, device="cuda:0") for i in range(16)}  # 16 MiB: 4 buckets
    async with receiver_process(state, {}, forward=True) as push:
        for version in (1, 2):
            _, forwarded = await push(state, version)
            assert forwarded == [0, 2] * version  # even buckets forwarded, odd ones applied
        _, forwarded = await push({n: -t for n, t in state.items()}, 3)  # temporaries: shared too
        assert forwarded == [0, 2] * 3
    async with receiver_process(state, {"direct": False}, forward=True) as push:
        _, forwarded = await push(state, 1)
        assert forwarded == []


@pytest.mark.transformers
async def test_transformers_engine_on_gpu_receives_over_cuda_ipc(tiny_model):
    from rollout_engines import EngineConfig, GenerateRequest, SamplingParams
    from rollout_engines.process import ProcessEngine
    from rollout_engines.weights.session import connect_weight_sync
    from wsync_helpers import tiny_state

    greedy = GenerateRequest(prompt_token_ids=[[5, 6, 7]], sampling=SamplingParams(temperature=0, max_tokens=8))
    engine = ProcessEngine(EngineConfig(backend="transformers", model=str(tiny_model), dtype="float32", device="cuda:0"))
    try:
        before = [c.token_ids for c in await engine.generate(greedy)]
        new = {k: v.cuda() for k, v in tiny_state(str(tiny_model), noise=1.0).items()}
        orig = {k: v.cuda() for k, v in tiny_state(str(tiny_model)).items()}
        sync = await connect_weight_sync([engine], "cuda_ipc", bucket_bytes=2**20, timeout_s=60)
        await sync.push(new, version=1)
        assert [c.token_ids for c in await engine.generate(greedy)] != before
        await sync.push(orig, version=2)
        assert [c.token_ids for c in await engine.generate(greedy)] == before
        await sync.close()
    finally:
        await engine.close()


@pytest.mark.transformers
@pytest.mark.parametrize("where", ["cuda", "cpu"])
async def test_engine_in_the_trainers_own_process_receives_over_cuda_ipc(tiny_model, where):
    """CUDA refuses to open a process's own IPC handle: an engine hosted in the trainer's process
    reads the trainer's tensors through their pointers (``cuda``: zero-copy) or the sender's
    bucket slot itself (``cpu``: tensors packed into the slot)."""
    from rollout_engines import EngineConfig, GenerateRequest, SamplingParams, create_engine
    from rollout_engines.weights.session import connect_weight_sync
    from wsync_helpers import tiny_state

    greedy = GenerateRequest(prompt_token_ids=[[5, 6, 7]], sampling=SamplingParams(temperature=0, max_tokens=8))
    engine = create_engine(EngineConfig(backend="transformers", model=str(tiny_model), dtype="float32", device="cuda:0"))
    try:
        before = [c.token_ids for c in await engine.generate(greedy)]
        new = {k: v.to(where) for k, v in tiny_state(str(tiny_model), noise=1.0).items()}
        orig = {k: v.to(where) for k, v in tiny_state(str(tiny_model)).items()}
        sync = await connect_weight_sync([engine], "cuda_ipc", bucket_bytes=2**20, timeout_s=60)
        for _ in range(2):
            await sync.push(new, version=engine.weight_version + 1)
            assert [c.token_ids for c in await engine.generate(greedy)] != before
            await sync.push(orig, version=engine.weight_version + 1)
            assert [c.token_ids for c in await engine.generate(greedy)] == before
        await sync.close()
    finally:
        await engine.close()
