"""Bucket payloads for SGLang, with real tensors: per-TP-rank flattened payloads of a core bucket
and the copy-plan loader's payloads survive serialization (in this process and in another one) and
rebuild exactly; the compacted layout for ``sglang_nccl`` equals the buffer SGLang allocates for
the same names."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest
import torch
from rollout_engines.weights.buckets import alloc_bucket, pack_bucket
from rollout_engines.weights.manifest import plan_manifest, specs_of
from rollout_engines_sglang import loader, payloads
from rollout_engines_sglang._tensor_bucket import FlattenedTensorBucket


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(37, 16, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(5, 3, generator=g).to(torch.float16),
        "model.position_ids": torch.arange(11, dtype=torch.int64),
        "model.norm.weight": torch.randn(16, generator=g),
    }


def _bucket(tensors: dict[str, torch.Tensor], bucket_bytes: int = 1 << 20):
    manifest = plan_manifest(specs_of(list(tensors.items())), version=1, bucket_bytes=bucket_bytes)
    bufs = []
    for b in manifest.buckets:
        buf = alloc_bucket(b.nbytes)
        buf.zero_()
        bufs.append(pack_bucket(manifest, b.index, tensors, buf))
    return manifest, bufs


def _rebuild(blob: bytes) -> dict[str, torch.Tensor]:
    payload = pickle.loads(blob)
    bucket = FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"])
    return {n: t.clone() for n, t in bucket.reconstruct_tensors()}


def _child(blob: bytes, conn) -> None:  # runs in a spawned process: only the payload crosses
    rebuilt = _rebuild(blob)
    conn.send({n: (str(t.dtype), tuple(t.shape), t.float().sum().item()) for n, t in rebuilt.items()})
    conn.close()


def test_one_payload_per_tp_rank_rebuilds_every_tensor() -> None:
    tensors = _tensors()
    manifest, (buf,) = _bucket(tensors)
    # The core bucket has padding between tensors; SGLang's metadata points past it.
    assert manifest.buckets[0].nbytes > sum(t.numel() * t.element_size() for t in tensors.values())
    blobs = payloads.flattened_bucket_payloads(buf, manifest.bucket_tensors(0), tp_size=3)
    assert len(blobs) == 3 and all(isinstance(b, bytes) for b in blobs)
    for blob in blobs:
        rebuilt = _rebuild(blob)
        assert list(rebuilt) == list(tensors)
        for name, t in tensors.items():
            assert rebuilt[name].dtype == t.dtype and torch.equal(rebuilt[name], t), name


def test_payload_references_the_bucket_without_copying() -> None:
    tensors = _tensors()
    manifest, (buf,) = _bucket(tensors)
    (blob,) = payloads.flattened_bucket_payloads(buf, manifest.bucket_tensors(0), tp_size=1)
    payload = pickle.loads(blob)
    # Shared memory: a write into the trainer's bucket is seen through the payload.
    first = manifest.bucket_tensors(0)[0]
    buf[first.offset : first.offset + 4].view(torch.float32).fill_(42.0)
    rebuilt = dict(FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"]).reconstruct_tensors())
    assert rebuilt[first.name].flatten()[0].item() == 42.0


def test_payload_rebuilds_in_another_process() -> None:
    tensors = _tensors()
    manifest, (buf,) = _bucket(tensors)
    blobs = payloads.flattened_bucket_payloads(buf, manifest.bucket_tensors(0), tp_size=2)
    ctx = mp.get_context("spawn")
    seen = []
    for blob in blobs:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(blob, child))
        proc.start()
        assert parent.poll(120), "child did not answer"
        seen.append(parent.recv())
        proc.join(30)
        assert proc.exitcode == 0
    for got in seen:
        for name, t in tensors.items():
            dtype, shape, total = got[name]
            assert dtype == str(t.dtype) and shape == tuple(t.shape)
            assert abs(total - t.float().sum().item()) < 1e-3, name


def test_several_buckets_each_rebuild_their_own_tensors() -> None:
    tensors = _tensors()
    manifest, bufs = _bucket(tensors, bucket_bytes=1024)
    assert len(manifest.buckets) > 1
    seen = {}
    for b, buf in zip(manifest.buckets, bufs, strict=True):
        (blob,) = payloads.flattened_bucket_payloads(buf, manifest.bucket_tensors(b.index), tp_size=1)
        seen.update(_rebuild(blob))
    assert set(seen) == set(tensors)
    assert all(torch.equal(seen[n], t) for n, t in tensors.items())


def test_compacted_chunks_are_sglangs_receive_layout() -> None:
    tensors = _tensors()
    manifest, (buf,) = _bucket(tensors)
    placements = manifest.bucket_tensors(0)
    chunks = payloads.aligned_chunks(placements)
    # The 7-element bfloat16 bias leaves the next tensor at an odd offset: a second broadcast.
    assert [[p.name for p in c] for c in chunks] == [list(tensors)[:3], list(tensors)[3:]]
    rebuilt = {}
    for chunk in chunks:
        packed = payloads.compact_bucket(buf, chunk)
        # What SGLang's _update_bucketed_weights_from_distributed allocates for these arguments.
        args = payloads.distributed_args(chunk)
        expected = FlattenedTensorBucket(named_tensors=[(n, tensors[n]) for n in args["names"]]).get_flattened_tensor()
        assert packed.numel() == payloads.packed_nbytes(chunk) == expected.numel()
        assert torch.equal(packed, expected)
        empties = [(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(*args.values(), strict=True)]
        recv = FlattenedTensorBucket(named_tensors=empties)
        recv.get_flattened_tensor().copy_(packed)  # what the broadcast does
        rebuilt.update(recv.reconstruct_tensors())  # raises on a misaligned view
    assert all(torch.equal(rebuilt[n], t) for n, t in tensors.items())


def test_misaligned_packing_is_what_chunks_avoid() -> None:
    tensors = _tensors()
    names = list(tensors)
    whole = FlattenedTensorBucket(named_tensors=[(n, tensors[n]) for n in names])
    with pytest.raises(RuntimeError, match="divisible"):
        whole.reconstruct_tensors()  # SGLang's receiver would fail the same way on one buffer
    same_dtype = {f"w{i}": torch.randn(i + 1) for i in range(5)}
    manifest, _ = _bucket(same_dtype)
    assert len(payloads.aligned_chunks(manifest.bucket_tensors(0))) == 1


def test_stage_views_copies_into_one_aligned_buffer() -> None:
    tensors = _tensors()
    named = list(tensors.items())
    staging, flat, meta = payloads.stage_views(named, None, torch.device("cpu"))
    assert all(m.start_idx % 256 == 0 for m in meta)
    again, _, _ = payloads.stage_views(named, staging, torch.device("cpu"))
    assert again is staging  # reused when large enough
    rebuilt = dict(FlattenedTensorBucket(flattened_tensor=flat, metadata=meta).reconstruct_tensors())
    assert all(torch.equal(rebuilt[n], t) for n, t in tensors.items())
    blobs = payloads.serialize_per_rank(flat, meta, 2)
    assert len(blobs) == 2
    for blob in blobs:  # each rank unpickles its own payload, once
        rebuilt = _rebuild(blob)
        assert all(torch.equal(rebuilt[n], t) for n, t in tensors.items())


def test_stager_keeps_the_buffer_and_the_views_of_a_layout() -> None:
    tensors = _tensors()
    named = list(tensors.items())
    stager = payloads.Stager(torch.device("cpu"))
    flat, meta, _ = stager.stage(named)
    rebuilt = dict(FlattenedTensorBucket(flattened_tensor=flat, metadata=meta).reconstruct_tensors())
    assert all(torch.equal(rebuilt[n], t) for n, t in tensors.items())
    # The next push of the same layout: new values, the same buffer, views and metadata.
    changed = [(n, t + 1) for n, t in named]
    flat2, meta2, _ = stager.stage(changed)
    assert flat2.data_ptr() == flat.data_ptr() and meta2 is meta
    rebuilt = dict(FlattenedTensorBucket(flattened_tensor=flat2, metadata=meta2).reconstruct_tensors())
    assert all(torch.equal(rebuilt[n], t) for n, t in changed)
    # Another layout (a smaller bucket) shares the buffer; a larger one grows it and starts over.
    small = named[:1]
    flat3, _, _ = stager.stage(small)
    assert flat3.data_ptr() == flat.data_ptr()
    big = [("big", torch.ones(flat.numel() + 1000, dtype=torch.uint8))]
    flat4, _, _ = stager.stage(big)
    assert flat4.numel() > flat.numel() and bool((flat4[: flat.numel() + 1000] == 1).all())
    flat5, meta5, _ = stager.stage(changed)
    assert flat5.data_ptr() == flat4.data_ptr() and meta5 is not meta
    rebuilt = dict(FlattenedTensorBucket(flattened_tensor=flat5, metadata=meta5).reconstruct_tensors())
    assert all(torch.equal(rebuilt[n], t) for n, t in changed)
    # Layouts are remembered up to a bound (each step of a delta push may bring a new one).
    for k in range(3 * stager.MAX_LAYOUTS):
        stager.stage([(f"t{k}", torch.zeros(4))])
    assert len(stager._layouts) <= stager.MAX_LAYOUTS


def _loader_views(blob: bytes) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What the copy-plan loader gets from one rank's payload (a named-tensor list: the flat
    buffer, its layout in the name) and the views it rebuilds."""
    ((name, flat),) = pickle.loads(blob)
    assert isinstance(name, str) and flat.dtype == torch.uint8 and flat.dim() == 1
    return flat, dict(loader.bucket_views(flat, loader.parse_bucket_name(name)))


def _loader_child(blob: bytes, conn) -> None:  # runs in a spawned process: only the payload crosses
    _, rebuilt = _loader_views(blob)
    conn.send({n: (str(t.dtype), tuple(t.shape), t.float().sum().item()) for n, t in rebuilt.items()})
    conn.close()


def test_loader_payload_rebuilds_views_of_one_buffer() -> None:
    tensors = _tensors()
    _, flat, meta = payloads.stage_views(list(tensors.items()), None, torch.device("cpu"))
    blobs = payloads.loader_payloads(flat, meta, tp_size=2)
    assert len(blobs) == 2 and blobs[0] is not blobs[1]  # one serialization per rank
    received = [_loader_views(blob) for blob in blobs]  # each rank unpickles its own payload, once
    for buffer, rebuilt in received:
        assert list(rebuilt) == list(tensors)
        for n, t in tensors.items():
            view = rebuilt[n]
            assert view.dtype == t.dtype and torch.equal(view, t), n
            # a view of the one received buffer, no copy
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    # Shared memory, as over CUDA IPC: the engine's staging buffer is what the views read.
    flat.zero_()
    assert all(not bool(t.any()) for t in received[0][1].values())


def test_loader_payload_rebuilds_in_another_process() -> None:
    tensors = _tensors()
    _, flat, meta = payloads.stage_views(list(tensors.items()), None, torch.device("cpu"))
    (blob,) = payloads.loader_payloads(flat, meta, tp_size=1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_loader_child, args=(blob, child))
    proc.start()
    assert parent.poll(120), "child did not answer"
    got = parent.recv()
    proc.join(30)
    assert proc.exitcode == 0
    for name, t in tensors.items():
        dtype, shape, total = got[name]
        assert dtype == str(t.dtype) and shape == tuple(t.shape)
        assert abs(total - t.float().sum().item()) < 1e-3, name
