"""The weight-sync manifest, buckets and the in-process path, with real tensors."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_engines import ManifestMismatch, WeightSyncError
from rollout_engines.weights.buckets import BucketHeader, alloc_bucket, bucket_views, checksum, pack_bucket
from rollout_engines.weights.manifest import (
    ALIGN,
    TensorSpec,
    WeightManifest,
    plan_manifest,
    specs_of,
    validate_manifest,
)
from rollout_engines.weights.receiver import StateDictTarget


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(10, 7, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "c": torch.arange(5, dtype=torch.int64),
        "big": torch.randn(64, 64, generator=g),
    }


def test_plan_respects_bucket_bound_and_alignment() -> None:
    tensors = _tensors()
    m = plan_manifest(specs_of(list(tensors.items())), version=3, bucket_bytes=1024)
    assert m.version == 3 and m.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    # "big" (16 KiB) exceeds the bound and gets a bucket of its own; the rest share buckets.
    big = next(t for t in m.tensors if t.name == "big")
    assert m.buckets[big.bucket].tensors == (3,)
    for t in m.tensors:
        assert t.offset % ALIGN == 0
    for b in m.buckets:
        if len(b.tensors) > 1:
            assert b.nbytes <= 1024


def test_pack_unpack_roundtrip_and_checksum() -> None:
    tensors = _tensors()
    m = plan_manifest(specs_of(list(tensors.items())), version=1, bucket_bytes=4096)
    got = {}
    for b in m.buckets:
        buf = pack_bucket(m, b.index, tensors, alloc_bucket(b.nbytes))
        c = checksum(buf)
        assert checksum(buf.clone()) == c
        for name, view in bucket_views(buf, m.bucket_tensors(b.index)):
            got[name] = view.clone()
        buf[0] ^= 1
        assert checksum(buf) != c
    for name, t in tensors.items():
        assert torch.equal(got[name], t)


def test_manifest_rejects_inconsistent_layout() -> None:
    m = plan_manifest([TensorSpec(name="x", dtype="float32", shape=(4,))], version=1)
    data = m.model_dump()
    data["total_bytes"] = 3
    with pytest.raises(ValueError, match="total_bytes"):
        WeightManifest.model_validate(data)


def test_validate_lists_every_problem_before_applying() -> None:
    model = torch.nn.Linear(4, 3)
    expected = StateDictTarget(model).expected_specs()
    bad = plan_manifest(
        [
            TensorSpec(name="weight", dtype="float32", shape=(4, 3)),
            TensorSpec(name="bias", dtype="float16", shape=(3,)),
            TensorSpec(name="nope", dtype="float32", shape=(1,)),
        ],
        version=2,
    )
    with pytest.raises(ManifestMismatch) as info:
        validate_manifest(bad, expected)
    msg = str(info.value)
    assert "unknown tensor 'nope'" in msg
    assert "'weight': shape [4, 3] != model's [3, 4]" in msg
    assert "'bias': dtype float16 != model's float32" in msg


def test_inproc_push_is_atomic_on_rejection_and_next_push_works() -> None:
    """A rejected update changes nothing; the next valid one lands (engine-free, receiver level)."""
    from rollout_engines.weights.manifest import TransportSpec
    from rollout_engines.weights.receiver import WeightReceiver
    from rollout_engines.weights.transports.inproc import InprocSender

    model = torch.nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    receiver = WeightReceiver(StateDictTarget(model))
    sender = InprocSender(session_id="t1", world_size=2, timeout_s=5, options={})
    receiver.connect(TransportSpec(transport="inproc", session_id="t1", world_size=2, timeout_s=5))
    sender.connect()

    def push(tensors: dict[str, torch.Tensor], version: int) -> None:
        m = plan_manifest(specs_of(list(tensors.items())), version=version, bucket_bytes=256)

        async def go() -> None:
            async def send() -> None:
                sender.begin(m)
                for b in m.buckets:
                    buf = pack_bucket(m, b.index, tensors, alloc_bucket(b.nbytes))
                    await asyncio.to_thread(sender.send_bucket, BucketHeader(index=b.index, nbytes=b.nbytes, checksum=checksum(buf)), buf)

            results = await asyncio.gather(send(), asyncio.to_thread(receiver.receive, m), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r

        asyncio.run(go())

    with pytest.raises(ManifestMismatch):
        push({"weight": torch.zeros(3, 4), "bias": torch.zeros(5)}, version=1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    push({"weight": torch.ones(3, 4), "bias": torch.full((3,), 2.0)}, version=2)
    assert receiver.version == 2
    assert torch.equal(model.weight, torch.ones(3, 4)) and torch.equal(model.bias, torch.full((3,), 2.0))


def test_sender_abort_reaches_receiver() -> None:
    from rollout_engines.weights.manifest import TransportSpec
    from rollout_engines.weights.receiver import WeightReceiver
    from rollout_engines.weights.transports.inproc import InprocSender

    model = torch.nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    receiver = WeightReceiver(StateDictTarget(model), label="engine 0")
    receiver.connect(TransportSpec(transport="inproc", session_id="t2", world_size=2, timeout_s=5))
    sender = InprocSender(session_id="t2", world_size=2, timeout_s=5, options={})
    sender.connect()
    m = plan_manifest(specs_of(list(model.state_dict().items())), version=1, bucket_bytes=256)
    sender.begin(m)
    sender.abort("trainer crashed")
    with pytest.raises(WeightSyncError, match="the sender aborted update v1: trainer crashed; peer: trainer"):
        receiver.receive(m)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_manifest_crosses_a_process_hop_as_a_layout_string_parsed_once():
    import pickle

    from rollout_engines.weights.manifest import manifest_from_wire, manifest_to_wire, plan_manifest, specs_of

    named = [(f"w{i}", torch.zeros(4, 3 + i)) for i in range(5)]
    first = plan_manifest(specs_of(named), version=1, bucket_bytes=1024)
    second = first.model_copy(update={"version": 2, "session_id": "next"})
    a = manifest_from_wire(pickle.loads(pickle.dumps(manifest_to_wire(first))))
    b = manifest_from_wire(pickle.loads(pickle.dumps(manifest_to_wire(second))))
    assert a == first and b == second and (b.version, b.session_id) == (2, "next")
    assert b.tensors is a.tensors  # the known layout was reused, not parsed again
    other = plan_manifest(specs_of(named[:4]), version=3, bucket_bytes=1024)
    c = manifest_from_wire(manifest_to_wire(other))
    assert c == other and c.tensors is not a.tensors
