"""Delta pushes: only what changed since the last complete update travels, and only onto its base.

Real engines (the embedded transformers engine on the tiny model) in this process (``inproc``), in
their own process (``gloo``, ``disk``, ``shm``) and behind a server (``http``).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path

import pytest
import torch
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams, create_engine
from rollout_engines.errors import ManifestMismatch, StaleVersion
from rollout_engines.process import ProcessEngine
from rollout_engines.weights.delta import DeltaBaseMismatch, DeltaTracker, digest, fingerprint
from rollout_engines.weights.manifest import (
    SPARSE_INDEX,
    SPARSE_VALUE,
    DeltaSpec,
    manifest_from_wire,
    manifest_to_wire,
    plan_manifest,
    specs_of,
    validate_manifest,
)
from rollout_engines.weights.session import connect_weight_sync
from wsync_helpers import bench_receiver, tiny_state

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(300)]
GREEDY = GenerateRequest(prompt_token_ids=[[5, 6, 7], [100, 200], [42]],
                         sampling=SamplingParams(temperature=0, max_tokens=8))
BUCKET = 2**18  # several buckets: sparse pieces and whole tensors spread over them
SPARSE_TENSOR = "model.layers.0.mlp.up_proj.weight"  # 2% of it changes: goes sparse
WHOLE_TENSOR = "model.layers.1.self_attn.o_proj.weight"  # all of it changes: goes whole


@pytest.fixture(scope="module")
def tiny_path(tiny_model):
    return str(tiny_model)


@pytest.fixture(scope="module")
def base(tiny_path):
    # Tied: the embedding and the LM head are one tensor under two names, as a trainer's state dict.
    return tiny_state(tiny_path)


def changed(state: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy of ``state`` where 2% of one tensor and all of another differ (enough to change greedy
    tokens); every other tensor is the very same object, bit-identical."""
    out = dict(state)
    gen = torch.Generator().manual_seed(seed)
    t = state[SPARSE_TENSOR].clone()
    index = torch.randperm(t.numel(), generator=gen)[: t.numel() // 50]
    t.view(-1)[index] += 3.0
    out[SPARSE_TENSOR] = t
    out[WHOLE_TENSOR] = state[WHOLE_TENSOR] + 0.5 * torch.randn(state[WHOLE_TENSOR].shape, generator=gen)
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


async def greedy(engine) -> list[list[int]]:
    return [c.token_ids for c in await engine.generate(GREEDY)]


async def delta_back_to_base(sync, engine, base, version: int, before: list[list[int]]) -> None:
    """A delta push of ``base`` (its last complete push was of another state) is small and gives
    back the base's outputs ``before``."""
    await sync.push(base, version=version)
    assert sync.last_push_bytes < 0.1 * sum(nbytes(t) for t in base.values())
    assert await greedy(engine) == before


@contextlib.contextmanager
def make_engine(transport: str, path: str):
    """The transformers engine where ``transport`` reaches it."""
    with contextlib.ExitStack() as stack:
        config = EngineConfig(backend="transformers", model=path, dtype="float32", device="cpu")
        if transport == "inproc":
            engine = create_engine(config)
        elif transport == "http":
            pytest.importorskip("rollout_engines_remote")
            from rollout_engines_remote.launch import ServerProcess

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            server = stack.enter_context(ServerProcess("transformers", path, options={"dtype": "float32"},
                                                       log=tmp / "server.log"))
            engine = create_engine("remote", model=server.url, api_key=server.api_key)
        else:
            engine = ProcessEngine(config)
        try:
            yield engine
        finally:
            asyncio.run(engine.close())


@pytest.mark.parametrize("transport", ["inproc", "gloo", "disk", "shm", "http"])
def test_delta_push_equals_full_push_and_sends_only_changes(tiny_path, base, transport):
    new = changed(base)
    full_bytes = sum(nbytes(t) for t in base.values())
    # Sparse: 2% of the tensor as int32 indices and float32 values (plus alignment); whole: itself.
    sparse_bytes = 2 * (nbytes(base[SPARSE_TENSOR]) // 50)

    async def run(engine) -> None:
        before = await greedy(engine)
        sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=120, delta=True)
        v = engine.weight_version
        try:
            await sync.push(base, version=v + 1)  # the first push of a tracking session is full
            assert sync.last_push_model_bytes == full_bytes
            assert sync.last_push_bytes >= full_bytes
            assert await greedy(engine) == before

            await sync.push(new, version=v + 2)
            assert sync.last_push_model_bytes == full_bytes
            sent = sync.last_push_bytes
            assert sent <= nbytes(new[WHOLE_TENSOR]) + sparse_bytes + 4 * 256, sent
            assert sent < 0.1 * full_bytes
            after_delta = await engine.generate(GREEDY)
            assert {c.weight_version for c in after_delta} == {v + 2}
            tokens_delta = [c.token_ids for c in after_delta]
            assert tokens_delta != before

            # Nothing changed: nothing is sent, the version still moves on.
            await sync.push(new, version=v + 3)
            assert sync.last_push_bytes == 0
            assert engine.weight_version == v + 3
            assert await greedy(engine) == tokens_delta

            # Back to the base: a full push of it restores the original outputs ...
            await sync.push(base, version=v + 4, delta=False)
            assert sync.last_push_bytes >= full_bytes
            assert await greedy(engine) == before
            # ... and a full push of the new state gives exactly what the delta gave.
            await sync.push(new, version=v + 5, delta=False)
            assert await greedy(engine) == tokens_delta
            # Versions still only go up, delta or not.
            with pytest.raises(StaleVersion):
                await sync.push(base, version=v + 5)
            await delta_back_to_base(sync, engine, base, v + 6, before)  # the full push above is its base
        finally:
            await sync.close()

    with make_engine(transport, tiny_path) as engine:
        asyncio.run(run(engine))


@pytest.mark.parametrize("transport", ["inproc", "gloo"])
def test_delta_on_the_wrong_base_is_refused_then_a_full_push_works(tiny_path, base, transport):
    new = changed(base)
    full_bytes = sum(nbytes(t) for t in base.values())

    async def run(engine) -> None:
        sync = await connect_weight_sync([engine], transport, bucket_bytes=BUCKET, timeout_s=120, delta=True)
        v = engine.weight_version
        try:
            await sync.push(base, version=v + 1)
            before = await greedy(engine)
            # The trainer's record of the base no longer matches what the engine holds.
            tracker = sync._tracker
            assert tracker is not None
            tracker.fingerprints[SPARSE_TENSOR] ^= 1
            with pytest.raises(DeltaBaseMismatch, match="push a full update"):
                await sync.push(new, version=v + 2)
            assert engine.weight_version == v + 1
            assert await greedy(engine) == before  # nothing was applied
            # The session knows: its next push is full, and it lands.
            await sync.push(new, version=v + 2)
            assert sync.last_push_bytes >= full_bytes
            assert engine.weight_version == v + 2
            assert await greedy(engine) != before
            await delta_back_to_base(sync, engine, base, v + 3, before)  # deltas work again on top of it
        finally:
            await sync.close()

    with make_engine(transport, tiny_path) as engine:
        asyncio.run(run(engine))


def test_engine_on_another_version_gets_a_full_push(tiny_path, base):
    """An engine whose version moved another way (another session) gets a full update, not a delta."""
    new = changed(base)
    full_bytes = sum(nbytes(t) for t in base.values())

    async def run(engine) -> None:
        sync = await connect_weight_sync([engine], "inproc", bucket_bytes=BUCKET, timeout_s=60, delta=True)
        try:
            await sync.push(base, version=1)
            engine.weight_version = 7  # as after a push from elsewhere
            await sync.push(new, version=8)
            assert sync.last_push_bytes >= full_bytes
        finally:
            await sync.close()

    with make_engine("inproc", tiny_path) as engine:
        asyncio.run(run(engine))


# ---- the receiver on its own: a module changed behind its back, a target that cannot read ------------
class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 8)


def _receiving_engine(target_cls=None):
    return bench_receiver(_Model().state_dict(), target_cls)


class _NoCurrent:
    """A target that can load tensors but not read them back (as some plugin backends)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def expected_specs(self):
        return self.inner.expected_specs()

    def apply(self, named, *, owned):
        self.inner.apply(named, owned=owned)


def _state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in _Model().state_dict().items()}


async def test_weights_changed_behind_the_receiver_refuse_a_sparse_delta():
    engine = _receiving_engine()
    state = _state(0)
    sync = await connect_weight_sync([engine], "inproc", timeout_s=30, delta=True)
    try:
        await sync.push(state, version=1)
        engine.target.tensors["a.weight"][0, 0] += 1.0  # not through the receiver
        state["a.weight"].view(-1)[:10] -= 1.0
        with pytest.raises(DeltaBaseMismatch, match="not the value the base recorded"):
            await sync.push(state, version=2)
        assert engine.weight_version == 1
        await sync.push(state, version=2)  # full
        assert all(torch.equal(engine.target.tensors[k], v) for k, v in state.items())
    finally:
        await sync.close()
        await engine.close()


async def test_target_without_current_values_takes_whole_tensors_only():
    engine = _receiving_engine(_NoCurrent)
    state = _state(0)
    sync = await connect_weight_sync([engine], "inproc", timeout_s=30, delta=True)
    try:
        await sync.push(state, version=1)
        state["a.weight"].view(-1)[:10] -= 1.0
        with pytest.raises(DeltaBaseMismatch) as info:
            await sync.push(state, version=2)
        assert info.value.__cause__.sparse_unsupported
        await sync.push(state, version=2)  # full
        state["a.weight"].view(-1)[:10] += 2.0
        await sync.push(state, version=3)  # a delta with the changed tensor whole
        assert sync.last_push_bytes == 64 * 64 * 4
        assert all(torch.equal(engine.target.tensors[k], v) for k, v in state.items())
    finally:
        await sync.close()
        await engine.close()


@pytest.mark.parametrize("mode", ["staged", "inplace"])
async def test_sparse_pieces_across_buckets_rebuild_bit_exact(mode):
    engine = _receiving_engine()
    engine.receiver.mode = mode
    state = _state(0)
    sync = await connect_weight_sync([engine], "inproc", timeout_s=30, delta=True, bucket_bytes=1024)
    try:
        await sync.push(state, version=1)
        flat = state["a.weight"].view(-1)
        flat[::37] = float("nan")  # bit-exact: NaNs and signed zeros included
        flat[1::41] = -0.0
        await sync.push(state, version=2)
        assert 0 < sync.last_push_bytes < 64 * 64 * 4
        got = engine.target.tensors["a.weight"]
        assert torch.equal(got.view(torch.int32), state["a.weight"].view(torch.int32))
    finally:
        await sync.close()
        await engine.close()


# ---- planning and the manifest --------------------------------------------------------------------------
def test_sparse_only_when_smaller_and_unchanged_tensors_skipped():
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(1000, generator=gen) for n in ("few", "most", "same")}
    tracker = DeltaTracker()
    first = tracker.plan(list(state.items()), delta=True, partial=False)
    assert first.spec.base_version is None and not first.skipped  # no base yet: full
    tracker.commit(first, version=1, partial=False)
    new = dict(state)
    new["few"] = state["few"].clone()
    new["few"][:20] += 1  # 2%: 20 int32 indices + 20 floats (+ alignment) < 4000 bytes
    new["most"] = state["most"].clone()
    new["most"][:600] += 1  # 60%: 600 * 8 bytes > 4000 bytes: whole
    plan = tracker.plan(list(new.items()), delta=True, partial=False)
    assert plan.skipped == ["same"]
    assert list(plan.sparse) == ["few"] and list(plan.whole) == ["most"]
    assert [n for n, _ in plan.items] == ["few" + SPARSE_INDEX, "few" + SPARSE_VALUE, "most"]
    assert plan.spec.base_version == 1 and plan.spec.base_digest == digest(tracker.fingerprints)
    assert plan.spec.fingerprints == {"few": fingerprint(new["few"]), "most": fingerprint(new["most"])}
    tracker.commit(plan, version=2, partial=False)
    assert all(torch.equal(tracker.base[n], new[n]) for n in new)
    # Another set of tensors than the base: a full push (which then says what is missing).
    fewer = tracker.plan([("few", new["few"])], delta=True, partial=False)
    assert fewer.spec.base_version is None and list(fewer.whole) == ["few"]


def test_delta_manifest_validation_and_wire():
    expected = {s.name: s for s in specs_of([("w", torch.zeros(10, 10))])}
    pieces = [("w" + SPARSE_INDEX, torch.zeros(3, dtype=torch.int32)), ("w" + SPARSE_VALUE, torch.zeros(3))]
    spec = DeltaSpec(base_version=1, base_digest="x", sparse=("w",), fingerprints={"w": 5})
    manifest = plan_manifest(specs_of(pieces), version=2, delta=spec)
    validate_manifest(manifest, expected)  # complete on top of its base
    back = manifest_from_wire(manifest_to_wire(manifest))
    assert back.delta == spec and back.version == 2
    # Without its delta, the same pieces are unknown tensors, and the update is incomplete.
    with pytest.raises(ManifestMismatch, match="unknown tensor"):
        validate_manifest(manifest.model_copy(update={"delta": None}), expected)
    bad = [("w" + SPARSE_INDEX, torch.zeros(3, dtype=torch.float32)), ("w" + SPARSE_VALUE, torch.zeros(3))]
    with pytest.raises(ManifestMismatch, match="indices must be 1-D int32 or int64"):
        validate_manifest(plan_manifest(specs_of(bad), version=2, delta=spec), expected)
    lone = [("w" + SPARSE_VALUE, torch.zeros(3))]
    with pytest.raises(ManifestMismatch, match="needs both"):
        validate_manifest(plan_manifest(specs_of(lone), version=2, delta=spec), expected)
    short = [("w" + SPARSE_INDEX, torch.zeros(3, dtype=torch.int64)), ("w" + SPARSE_VALUE, torch.zeros(2))]
    with pytest.raises(ManifestMismatch, match="one value of the model's dtype per index"):
        validate_manifest(plan_manifest(specs_of(short), version=2, delta=spec), expected)
