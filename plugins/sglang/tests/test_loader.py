"""The copy-plan loader SGLang calls for relayed pushes (``rollout_engines_sglang.loader``), with
real tensors: the payload the engine builds is unpickled as an SGLang rank does, the first bucket
loads through ``load_weights`` while the plan records, later ones are replayed by direct copies
and leave exactly the parameters ``load_weights`` would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import threading
from collections.abc import Iterator

import pytest
import torch
from rollout_engines.errors import WeightSyncError
from rollout_engines.proxy import raise_for_workers
from rollout_engines.weights.doorbell import Doorbell, new_door
from rollout_engines.weights.manifest import (
    TensorSpec,
    TransportSpec,
    manifest_to_wire,
    plan_manifest,
    specs_of,
)
from rollout_engines.weights.session import WeightSync
from rollout_engines.weights.transports.shm import ShmSender
from rollout_engines_sglang import loader, payloads

H, KV, FF, VOCAB = 8, 4, 12, 16


class Qwen2LikeSglang(torch.nn.Module):
    """A stand-in for SGLang's ``Qwen2ForCausalLM`` (python/sglang/srt/models/qwen2.py), one layer,
    TP rank ``rank`` of ``tp``: fused ``qkv_proj`` and ``gate_up_proj`` parameters, filled by
    ``load_weights`` through SGLang's ``stacked_params_mapping`` and per-parameter loaders that
    narrow the checkpoint tensor to this rank's shard and ``copy_`` it into a slice of the fused
    parameter (QKVParallelLinear / MergedColumnParallelLinear ``weight_loader``); other names go
    through ``default_weight_loader`` (a plain ``copy_``). ``rotary_emb.inv_freq`` and a tied
    ``lm_head.weight`` are skipped, as SGLang skips them. ``model.norm.weight`` is kept in float32
    while the checkpoint is bfloat16: its load converts, which a copy plan cannot replay."""

    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, tp: int = 2, rank: int = 1) -> None:
        super().__init__()
        self.tp, self.rank = tp, rank
        bf16 = torch.bfloat16

        def p(*shape: int, dtype: torch.dtype = bf16) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.params = {
            "model.embed_tokens.weight": p(VOCAB, H),
            "model.layers.0.self_attn.qkv_proj.weight": p((H + 2 * KV) // tp, H),
            "model.layers.0.self_attn.qkv_proj.bias": p((H + 2 * KV) // tp),
            "model.layers.0.self_attn.o_proj.weight": p(H, H // tp),
            "model.layers.0.mlp.gate_up_proj.weight": p(2 * FF // tp, H),
            "model.layers.0.mlp.down_proj.weight": p(H, FF // tp),
            "model.norm.weight": p(H, dtype=torch.float32),
        }
        for i, (name, param) in enumerate(self.params.items()):
            self.register_parameter(f"p{i}", param)
            param.weight_loader = self._loader_for(name)  # type: ignore[attr-defined]

    def _loader_for(self, name: str):  # type: ignore[no-untyped-def]
        if "qkv_proj" in name:
            return self._qkv_loader
        if "gate_up_proj" in name:
            return self._gate_up_loader
        if "o_proj" in name or "down_proj" in name:
            return self._row_loader
        return None

    def _qkv_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        sizes = {"q": H // self.tp, "k": KV // self.tp, "v": KV // self.tp}
        offset = {"q": 0, "k": sizes["q"], "v": sizes["q"] + sizes["k"]}[shard_id]
        size = sizes[shard_id]
        loaded = loaded.narrow(0, self.rank * size, size)
        param.data.narrow(0, offset, size).copy_(loaded)

    def _gate_up_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        size = FF // self.tp
        param.data.narrow(0, shard_id * size, size).copy_(loaded.narrow(0, self.rank * size, size))

    def _row_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.rank * size, size))

    def load_weights(self, weights) -> None:  # type: ignore[no-untyped-def]
        params_dict = self.params
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name or "lm_head.weight" in name:
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params_dict[name]
                param.weight_loader(param, loaded_weight, shard_id)  # type: ignore[attr-defined]
                break
            else:
                if name in params_dict:
                    param = params_dict[name]
                    load = param.weight_loader or _default_weight_loader  # type: ignore[attr-defined]
                    load(param, loaded_weight)


def _default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    attn = "model.layers.0.self_attn."
    return {
        "model.embed_tokens.weight": r(VOCAB, H),
        attn + "q_proj.weight": r(H, H), attn + "k_proj.weight": r(KV, H), attn + "v_proj.weight": r(KV, H),
        attn + "q_proj.bias": r(H), attn + "k_proj.bias": r(KV), attn + "v_proj.bias": r(KV),
        attn + "o_proj.weight": r(H, H),
        "model.layers.0.mlp.gate_proj.weight": r(FF, H), "model.layers.0.mlp.up_proj.weight": r(FF, H),
        "model.layers.0.mlp.down_proj.weight": r(H, FF),
        "model.layers.0.self_attn.rotary_emb.inv_freq": r(H // 2),
        "model.norm.weight": r(H),
        "lm_head.weight": r(VOCAB, H),
    }


def _received(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """What an SGLang rank hands its custom loader: the payload the engine builds for it,
    unpickled (then ``.to(device)``, a no-op here)."""
    _, flat, metadata = payloads.stage_views(list(tensors.items()), None, torch.device("cpu"))
    (blob,) = payloads.loader_payloads(flat, metadata, tp_size=1)
    return pickle.loads(blob)


def _spy(model: Qwen2LikeSglang) -> list[str]:
    seen: list[str] = []
    real = model.load_weights

    def load_weights(weights) -> None:  # type: ignore[no-untyped-def]
        items = list(weights)
        seen.extend(n for n, _ in items)
        real(items)

    model.load_weights = load_weights  # type: ignore[method-assign]
    return seen


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_first_bucket_loads_and_records_later_ones_replay_exactly() -> None:
    model, reference = Qwen2LikeSglang(), Qwen2LikeSglang()
    seen = _spy(model)
    first = _checkpoint(0)
    loader.load_bucket(model, _received(first))
    reference.load_weights(list(first.items()))
    _assert_same(model, reference)
    assert set(seen) == set(first)  # loaded for real, once, while recording
    plan = loader.planned_loader(model).plan
    # The converting norm, and the names SGLang skips (nothing to replay), stay on load_weights.
    assert plan.fallback == {"model.norm.weight", "lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"}

    for seed in (1, 2):
        seen.clear()
        new = _checkpoint(seed)
        loader.load_bucket(model, _received(new))
        reference.load_weights(list(new.items()))
        _assert_same(model, reference)
        assert sorted(seen) == sorted(plan.fallback)  # the rest by direct copies
    loader.forget(model)
    assert plan._views == {} and model not in loader._kept  # nothing of the pushes' buffers is kept
    assert loader.planned_loader(model) is loader.planned_loader(model)
    assert loader.planned_loader(reference) is not loader.planned_loader(model)  # one plan per model


def test_plain_named_tensors_pass_through() -> None:
    model, reference = Qwen2LikeSglang(), Qwen2LikeSglang()
    tensors = _checkpoint(3)
    plain = [("model.norm.weight", tensors.pop("model.norm.weight"))]
    loader.load_bucket(model, _received(tensors) + plain)
    reference.load_weights(list(tensors.items()) + plain)
    _assert_same(model, reference)


def test_bucket_layout_round_trips_through_the_name() -> None:
    entries = [
        loader.BucketEntry("model.embed_tokens.weight", torch.bfloat16, (16, 8), 0, 256),
        loader.BucketEntry("model.norm.weight", torch.float32, (8,), 256, 288),
        loader.BucketEntry("scalar", torch.int64, (), 512, 520),
    ]
    name = loader.bucket_name(entries)
    assert name.startswith(loader.PREFIX) and " " not in name
    assert loader.parse_bucket_name(name) == entries
    with pytest.raises(ValueError, match="not a bucket name"):
        loader.parse_bucket_name("model.norm.weight")
    with pytest.raises(ValueError, match="malformed"):
        loader.parse_bucket_name(loader.PREFIX + '[["w","no_such_dtype",[1],0,4]]')
    with pytest.raises(ValueError, match="malformed"):
        loader.parse_bucket_name(loader.PREFIX + "{not json")
    # A span that is not the tensor's size is refused where the layout is read, once, not left
    # to the views (which read from the start and the shape).
    for start, end, shape in ((0, 8, [1]), (4, 12, [3]), (-4, 0, [1]), (0, -4, [-1])):
        with pytest.raises(ValueError, match="malformed"):
            loader.parse_bucket_name(loader.PREFIX + f'[["w","float32",{shape},{start},{end}]]')
    # The views are of the buffer, where the entries say (an entry off its dtype's size too).
    flat = (torch.arange(300) % 251).to(torch.uint8)
    odd = loader.BucketEntry("odd", torch.float16, (3,), 289, 295)
    with pytest.raises(RuntimeError, match="divisible"):
        loader.bucket_views(flat, [odd])
    views = dict(loader.bucket_views(flat, [*entries[:2], loader.BucketEntry("odd", torch.float16, (3,), 290, 296)]))
    for e in entries[:2]:
        view = views[e.name]
        assert view.data_ptr() == flat.data_ptr() + e.start and view.shape == e.shape and view.dtype == e.dtype
        assert torch.equal(view.reshape(-1).view(torch.uint8), flat[e.start : e.end])
    assert torch.equal(views["odd"].view(torch.uint8), flat[290:296])


def test_a_forwarded_bucket_round_trips_through_the_name() -> None:
    from rollout_engines.weights.manifest import TensorPlacement

    placements = [
        TensorPlacement(name="model.embed_tokens.weight", dtype="bfloat16", shape=(16, 8), bucket=0, offset=0),
        TensorPlacement(name="model.norm.weight", dtype="float32", shape=(8,), bucket=0, offset=256),
    ]
    description = '{"segments":[["ab",4096,true,1]],"refs":[[0,0],[0,256]],"pid":7}'
    name = loader.shared_name(3, "GPU-1", description, placements)
    got = loader.parse_shared_name(name)
    assert (got.bucket, got.device_uuid, got.description) == (3, "GPU-1", description)
    assert got.placements == (
        TensorSpec(name="model.embed_tokens.weight", dtype="bfloat16", shape=(16, 8)),
        TensorSpec(name="model.norm.weight", dtype="float32", shape=(8,)),
    )
    assert [p.nbytes for p in got.placements] == [256, 32]
    with pytest.raises(ValueError, match="not a forwarded bucket"):
        loader.parse_shared_name(loader.PREFIX + "[]")
    for body in ('{"index":0}', '{"index":"0","uuid":"u","layout":[],"description":""}', "{not json",
                 '{"index":0,"uuid":"u","layout":[["w","no_such_dtype",[1]]],"description":""}'):
        with pytest.raises(ValueError, match="malformed forwarded bucket"):
            loader.parse_shared_name(loader.SHARED_PREFIX + body)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU can be read")
def test_the_probe_refuses_where_the_trainers_memory_cannot_be_opened() -> None:
    """The relay asks once (a PROBE entry) before it forwards buckets; without CUDA (or
    cuda-bindings, or on another GPU) the loader fails it, and the relay stages instead."""
    with pytest.raises(RuntimeError, match="relaying by staging"):
        loader.load_bucket(Qwen2LikeSglang(), [(loader.PROBE + "GPU-1", torch.zeros(1, dtype=torch.uint8))])


def test_the_relays_kept_buffer_is_viewed_once_and_forget_lets_go_of_it() -> None:
    """The relay stages every push into the buffer it keeps: the loader rebuilds nothing for a layout
    it saw in that buffer (same view objects, so the plan's copies replay), loads every push
    exactly, and a FORGET entry (sent before the relay frees the buffer) drops all it kept."""
    model, reference = Qwen2LikeSglang(), Qwen2LikeSglang()
    stager = payloads.Stager(torch.device("cpu"))

    def push(seed: int) -> list[tuple[str, torch.Tensor]]:
        tensors = _checkpoint(seed)
        flat, metadata, _ = stager.stage(list(tensors.items()))
        (blob,) = payloads.loader_payloads(flat, metadata, tp_size=1)
        loader.load_bucket(model, pickle.loads(blob))
        reference.load_weights(list(tensors.items()))
        _assert_same(model, reference)
        (entry,) = loader._kept[model].values()
        return entry[1]

    first = push(0)
    for seed in (1, 2):
        again = push(seed)
        assert all(a[1] is b[1] for a, b in zip(first, again, strict=True))  # the same views
    plan = loader.planned_loader(model).plan
    assert plan._views  # the sources of the copies, kept for the next push

    (blob,) = payloads.forget_payloads(stager.buffer, tp_size=1)
    loader.load_bucket(model, pickle.loads(blob))
    assert model not in loader._kept and plan._views == {}
    push(3)  # and loads as before


def test_a_grown_buffer_makes_the_loader_forget_the_old_one() -> None:
    model = Qwen2LikeSglang()
    tensors = _checkpoint(4)
    small = dict(list(tensors.items())[:3])
    for buffer, forget_first in ((small, True), (tensors, True)):
        _, flat, metadata = payloads.stage_views(list(buffer.items()), None, torch.device("cpu"))
        (blob,) = payloads.loader_payloads(flat, metadata, tp_size=1, forget_first=forget_first)
        loader.load_bucket(model, pickle.loads(blob))
        assert len(loader._kept[model]) == 1  # only the buffer of this push


# ---- the doorbell (option direct_receive) -----------------------------------------------------------
# A DOOR_PREFIX entry, handed to the loader as SGLang's scheduler hands it a payload, makes this
# process a receiver of a real weight-sync session (``shm``: a trainer's ShmSender and WeightSync
# streaming here, the store's signalling) as the relay's rank, with a listener thread; the engine's
# Doorbell then rings it with an update's manifest and the thread reads the trainer's buckets itself
# into the model through its copy plan, answering through the store. No fake: everything is the
# loader's and the core's own code, on the listener's thread.
RANK = 1


@contextlib.contextmanager
def trainer() -> Iterator[tuple[TransportSpec, WeightSync]]:
    """A trainer's ``shm`` session for one engine (the relay's rank, ``RANK``)."""
    sender = ShmSender(session_id="door" + new_door(), world_size=2, timeout_s=30, options={})
    spec = TransportSpec(transport="shm", session_id=sender.session_id, rank_offset=RANK, world_size=2,
                         timeout_s=30.0, options=sender.spec_options())
    sync = WeightSync([], sender, transport="shm", bucket_bytes=512, timeout_s=30, checksum="none", progress=False)
    try:
        yield spec, sync
    finally:
        sender.close()


def reference(version: int) -> Qwen2LikeSglang:
    model = Qwen2LikeSglang()
    model.load_weights(list(_checkpoint(version).items()))
    return model


def start_listener(spec: TransportSpec, model: Qwen2LikeSglang, token: torch.Tensor) -> str:
    """Start ``model``'s doorbell as SGLang's call of the loader would; returns its door's name."""
    door = new_door()
    loader.load_bucket(model, [(loader.door_name(spec.model_dump_json(), door, RANK), token)])
    return door


@contextlib.contextmanager
def doorbell(spec: TransportSpec, sync: WeightSync, model: Qwen2LikeSglang, token: torch.Tensor) -> Iterator[Doorbell]:
    """A doorbell for ``model`` and the engine's Doorbell to it (the trainer connected), both
    stopped afterwards."""
    bell = Doorbell(spec, start_listener(spec, model, token), [RANK])
    sync.sender.connect()  # the scheduler's receiver joined: its heartbeat is what the trainer waits for
    try:
        yield bell
    finally:
        loader.stop_door(model)
        bell.close()


def ring(bell: Doorbell, sync: WeightSync, version: int, wire: dict | None = None) -> None:
    """Push checkpoint ``version`` while the doorbell hands its manifest to the listener (or
    ``wire`` instead, with nothing pushed); raises what the listener answered."""
    state = _checkpoint(version)
    manifest = plan_manifest(specs_of(list(state.items())), version=version, bucket_bytes=512, transport="shm",
                             timeout_s=30)
    pushing = None
    if wire is None:
        wire = manifest_to_wire(manifest)
        pushing = threading.Thread(target=sync._stream, args=(manifest, iter(state.items())))
        pushing.start()
    assert bell.claim()
    answers = asyncio.run(bell.ring(wire, timeout_s=30, check=lambda: None))
    if pushing is not None:
        pushing.join(30)
    raise_for_workers(answers, "a ring", applies_weights=True, worker="SGLang scheduler")


def test_a_door_entry_makes_a_receiver_that_takes_rung_updates_until_forget_all() -> None:
    model, token = Qwen2LikeSglang(), torch.zeros(1, dtype=torch.uint8)
    threads: list[str] = []
    real = model.load_weights

    def load_weights(weights) -> None:  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        real(weights)

    model.load_weights = load_weights  # type: ignore[method-assign]
    with trainer() as (spec, sync), doorbell(spec, sync, model, token) as bell:
        door = loader._doors[model]
        # The first update of a layout goes through load_weights (the plan records), later ones
        # replay the plan: both on the doorbell's thread, leaving what load_weights leaves.
        for version in (1, 2, 3):
            ring(bell, sync, version)
            _assert_same(model, reference(version))
        assert set(threads) == {door.listener._thread.name}
        assert loader.planned_loader(model).plan.copies  # later updates replayed what the first recorded
        assert door.receiver.version == 3 and door.receiver.last_timings["total"] > 0
        assert door.listener.rings == 3
        # A ring whose manifest does not parse fails only itself, in its own answer.
        with pytest.raises(WeightSyncError, match="SGLang scheduler"):
            ring(bell, sync, 4, wire={"version": 4, "session_id": "x", "layout": "{not json"})
        _assert_same(model, reference(3))
        ring(bell, sync, 5)
        _assert_same(model, reference(5))
        # FORGET_ALL (the relay's weight transfer closing) stops the thread and closes the receiver.
        loader.load_bucket(model, [(loader.FORGET_ALL, token)])
        door.listener._thread.join(10)
        assert not door.listener._thread.is_alive() and model not in loader._doors
        assert door.receiver.transport is None


def test_a_new_door_replaces_the_old_one_and_a_bad_entry_is_refused() -> None:
    model, token = Qwen2LikeSglang(), torch.zeros(1, dtype=torch.uint8)
    with trainer() as (spec, sync):
        with pytest.raises(ValueError, match="malformed doorbell entry"):
            loader.load_bucket(model, [(loader.DOOR_PREFIX + '{"door": 1}', token)])
        # A spec that does not validate: the error names no part of it (SGLang logs loader errors).
        leaky = json.dumps({**json.loads(spec.model_dump_json()), "timeout_s": "soon"})
        with pytest.raises(ValueError, match="malformed doorbell entry") as refused:
            loader.load_bucket(model, [(loader.door_name(leaky, new_door(), RANK), token)])
        assert spec.options["secret"] not in str(refused.value) and refused.value.__cause__ is None
        # Transports this process cannot receive as the relay's rank, or not here.
        gloo = spec.model_copy(update={"transport": "gloo"}).model_dump_json()
        with pytest.raises(ValueError, match="no doorbell for 'gloo'"):
            loader.load_bucket(model, [(loader.door_name(gloo, new_door(), RANK), token)])
        ipc = spec.model_copy(update={"transport": "cuda_ipc"}).model_dump_json()
        with pytest.raises(RuntimeError, match="cuda_ipc doorbell needs|this SGLang rank is on GPU"):
            loader.load_bucket(model, [(loader.door_name(ipc, new_door(), RANK, "GPU-elsewhere"), token)])
        assert model not in loader._doors
        start_listener(spec, model, token)
        old = loader._doors[model]
        with doorbell(spec, sync, model, token) as bell:
            old.listener._thread.join(10)
            assert not old.listener._thread.is_alive() and loader._doors[model] is not old
            assert old.receiver.transport is None
            ring(bell, sync, 5)
            _assert_same(model, reference(5))


def test_a_load_by_sglangs_call_waits_for_a_ring_in_progress() -> None:
    """One lock around every load: SGLang's own call of the loader never runs beside the doorbell's."""
    model, token = Qwen2LikeSglang(), torch.zeros(1, dtype=torch.uint8)
    entered, go = threading.Event(), threading.Event()
    real = model.load_weights

    def slow(weights) -> None:  # noqa: ANN001 - the ring's load holds here until told to go on
        entered.set()
        assert go.wait(10)
        real(weights)

    model.load_weights = slow  # type: ignore[method-assign]
    with trainer() as (spec, sync), doorbell(spec, sync, model, token) as bell:
        ringer = threading.Thread(target=ring, args=(bell, sync, 6))
        ringer.start()
        assert entered.wait(10)
        other = threading.Thread(target=loader.load_bucket, args=(model, [("model.norm.weight", torch.ones(8))]))
        other.start()
        other.join(0.3)
        assert other.is_alive()  # waits for the ring's load
        go.set()
        ringer.join(10)
        other.join(10)
        assert not other.is_alive()
        assert torch.equal(model.params["model.norm.weight"], torch.ones(8))  # SGLang's load came last
