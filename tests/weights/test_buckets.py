"""Manifest planning, checksums and bucket packing with real tensors."""

from __future__ import annotations

import pytest
import torch
from rollout_engines.errors import ManifestMismatch, WeightSyncError
from rollout_engines.weights.buckets import (
    BucketHeader,
    BucketViews,
    alloc_bucket,
    bucket_views,
    check_bucket_tensors,
    checksum,
    checksum_tensors,
    expected_tensors,
    pack_bucket,
    views_at,
)
from rollout_engines.weights.manifest import ALIGN, TensorSpec, plan_manifest, specs_of, validate_manifest
from rollout_engines.weights.transports import _store
from rollout_engines.weights.transports.broadcast import _decode, _encode


def named() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("a", torch.randn(100, 7)),
        ("b", torch.randn(3).to(torch.bfloat16)),
        ("c", torch.randint(0, 100, (5, 5), dtype=torch.int64)),
        ("big", torch.randn(1000)),
        ("d", torch.randn(1, 1, 3).half()),
    ]


def test_plan_bounds_buckets_and_aligns_offsets():
    m = plan_manifest(specs_of(named()), version=3, bucket_bytes=3000)
    assert m.total_bytes == sum(t.numel() * t.element_size() for _, t in named())
    for b in m.buckets:
        tensors = m.bucket_tensors(b.index)
        # Bounded up to the alignment padding of the last tensor; a larger tensor gets its own bucket.
        assert b.nbytes <= 3000 + ALIGN or len(tensors) == 1
        assert all(t.offset % ALIGN == 0 for t in tensors)
    assert [t.name for t in m.tensors] == [n for n, _ in named()]
    assert len(m.buckets) >= 3


def test_pack_then_views_round_trip_every_dtype():
    items = named()
    m = plan_manifest(specs_of(items), version=1, bucket_bytes=4096)
    tensors = dict(items)
    for b in m.buckets:
        buf = pack_bucket(m, b.index, tensors, alloc_bucket(b.nbytes))
        for name, view in bucket_views(buf, m.bucket_tensors(b.index)):
            assert view.dtype == tensors[name].dtype and torch.equal(view, tensors[name])


def _plain(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return buf[offset : offset + n].view(dtype).view(shape)


@pytest.mark.parametrize("start", [0, 1, 2, 8])
def test_views_at_are_the_plain_views_at_any_start_and_offset(start):
    """The fast views (one as_strided on a view of the buffer as each dtype) are the plain ones:
    the same bytes, shapes, strides and dtype, for buffers that begin anywhere in their storage;
    a row torch cannot view in place (its bytes not on a multiple of its dtype's size in the
    storage) is refused as the plain way refuses it."""
    storage = torch.randint(0, 256, (4096 + start,), dtype=torch.uint8)
    buf = storage[start:]
    rows = [
        ("f32", torch.float32, (3, 5), 0), ("bf16", torch.bfloat16, (7,), 64), ("i64", torch.int64, (2, 2, 2), 256),
        ("odd", torch.float16, (4,), 301), ("scalar", torch.float64, (), 512), ("empty", torch.float32, (0, 3), 520),
        ("bool", torch.bool, (9,), 600), ("f8", torch.float8_e4m3fn, (5, 2), 611), ("last", torch.int32, (4,), 4080),
    ]
    viewable = 0
    for name, dtype, shape, offset in rows:
        try:
            plain = _plain(buf, dtype, shape, offset)
        except RuntimeError as exc:
            with pytest.raises(RuntimeError, match="divisible"):
                views_at(buf, [(name, dtype, shape, offset)])
            assert "divisible" in str(exc)
            continue
        viewable += 1
        ((got, view),) = views_at(buf, [(name, dtype, shape, offset)])
        assert got == name
        assert (view.dtype, view.shape, view.stride(), view.data_ptr()) == (
            plain.dtype, plain.shape, plain.stride(), plain.data_ptr()), name
        assert view.is_contiguous() and torch.equal(view.reshape(-1).view(torch.uint8), plain.reshape(-1).view(torch.uint8))
    assert viewable == sum((start + offset) % dtype.itemsize == 0 for _, dtype, _, offset in rows)
    if start % 8 == 0:  # every row but the odd one, at once
        views = dict(views_at(buf, [r for r in rows if r[0] != "odd"]))
        assert len(views) == 8
        views["f32"].fill_(1.5)  # views, not copies
        assert torch.equal(_plain(buf, torch.float32, (3, 5), 0), torch.full((3, 5), 1.5))


def test_views_at_refuse_a_row_past_the_buffer_even_inside_its_storage():
    storage = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(RuntimeError):
        views_at(storage[:512], [("past", torch.float32, (4,), 500)])
    assert views_at(storage[:512], [("fits", torch.float32, (3,), 500)])[0][1].numel() == 3


def test_pack_refuses_a_tensor_that_changed_since_planning():
    items = named()
    m = plan_manifest(specs_of(items), version=1)
    tensors = dict(items) | {"a": torch.randn(7, 100)}
    with pytest.raises(ValueError, match="changed since the manifest"):
        pack_bucket(m, 0, tensors, alloc_bucket(m.buckets[0].nbytes))


def test_checksum_detects_a_flipped_byte_and_odd_lengths():
    buf = torch.randint(0, 256, (4096 + 5,), dtype=torch.uint8)
    ref = checksum(buf)
    assert checksum(buf.clone()) == ref
    for pos in (0, 2000, 4096 + 4):
        bad = buf.clone()
        bad[pos] ^= 1
        assert checksum(bad) != ref
    assert checksum(buf, "none") == 0


def test_tensor_checksum_equals_the_packed_buckets_when_padding_is_zero():
    """Zero-copy buckets are checked tensor by tensor; with 8-byte-aligned placements and zeroed
    padding that is the same sum as over the packed buffer, and a changed byte shows."""
    items = named()
    m = plan_manifest(specs_of(items), version=1, bucket_bytes=1 << 20)
    tensors = dict(items)
    buf = pack_bucket(m, 0, tensors, torch.zeros(m.buckets[0].nbytes, dtype=torch.uint8))
    srcs = [tensors[p.name] for p in m.bucket_tensors(0)]
    assert checksum_tensors(srcs, "sum64") == checksum(buf, "sum64")
    changed = [t.clone() for t in srcs]
    changed[1].view(torch.uint8)[3] ^= 4  # a byte in the tail of an odd-sized tensor
    assert checksum_tensors(changed) != checksum_tensors(srcs)
    assert checksum_tensors(srcs, "none") == 0
    expected = expected_tensors(m, 0)
    check_bucket_tensors(expected, srcs)
    with pytest.raises(ValueError, match="changed since the manifest"):
        check_bucket_tensors(expected, [srcs[0].double(), *srcs[1:]])
    with pytest.raises(ValueError, match="changed since the manifest"):
        check_bucket_tensors(expected, [*srcs[:-1], srcs[-1].reshape(-1, 1)])


def test_default_checksum_sees_reordering_that_sum64_misses():
    """pos64 (the default) weighs each 256-byte block by its place: swapped tensors of one size and
    words moved across blocks change it; sum64 cannot see either."""
    a, b = torch.randn(64), torch.randn(64)  # 256 bytes each: one block
    pair = torch.cat([a, b]).view(torch.uint8)
    swapped = torch.cat([b, a]).view(torch.uint8)
    assert checksum(pair, "sum64") == checksum(swapped, "sum64")
    assert checksum(pair) != checksum(swapped)
    assert checksum_tensors([a, b], "sum64") == checksum_tensors([b, a], "sum64")
    assert checksum_tensors([a, b]) != checksum_tensors([b, a])
    assert checksum_tensors([a, b]) == checksum_tensors([a.clone(), b.clone()])
    # Words moved between blocks of one tensor (a rotated buffer).
    big = torch.randn(1024).view(torch.uint8)
    assert checksum(big) != checksum(torch.roll(big, 256))
    assert checksum(big, "sum64") == checksum(torch.roll(big, 256), "sum64")
    with pytest.raises(ValueError, match="unknown checksum"):
        checksum(big, "md5")


@pytest.mark.parametrize("value", [0, 1, -1, 2**63 - 1, -(2**63), 2**63 + 2**55, 12345678901234])
def test_broadcast_header_carries_any_checksum(value):
    header = BucketHeader(index=7, nbytes=1 << 40, checksum=value, status=0)
    back = _decode(_encode(header, torch.device("cpu")))
    assert (back.index, back.nbytes, back.checksum, back.status) == (7, 1 << 40, value, 0)


def test_validate_lists_every_problem():
    m = plan_manifest(specs_of(named()), version=4)
    expected = {n: TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape)) for n, t in named()}
    validate_manifest(m, expected)
    expected["a"] = TensorSpec(name="a", dtype="float32", shape=(7, 100))
    expected["c"] = TensorSpec(name="c", dtype="int32", shape=(5, 5))
    del expected["d"]
    with pytest.raises(ManifestMismatch) as info:
        validate_manifest(m, expected)
    text = str(info.value)
    assert "'a': shape [100, 7]" in text and "'c': dtype int64" in text and "unknown tensor 'd'" in text


def test_poll_times_out_with_the_callers_error_and_runs_checks():
    checks = []
    with pytest.raises(WeightSyncError, match="nothing came"):
        _store.poll(lambda: False, timeout_s=1.2, check=lambda: checks.append(1),
                    on_timeout=lambda: WeightSyncError("nothing came", peer="x", bucket=3))
    assert len(checks) >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_checksum_of_separate_tensors_matches_the_cpu_one():
    """On a GPU the sum64 of a zero-copy bucket runs as one chunked kernel where the tensors allow
    it; sender and receiver may take different paths, so the value must not depend on the path."""
    gen = torch.Generator().manual_seed(3)
    tensors = [
        torch.randint(-(2**62), 2**62, (2**18 + 2,), dtype=torch.int64, generator=gen),  # 2 MiB + 16 bytes
        torch.randn(64, 8, generator=gen).to(torch.bfloat16),
        torch.randn(5, 3, generator=gen),  # 60 bytes: not for the kernel, the whole bucket falls back
    ]
    for subset in (tensors[:2], tensors):
        want = checksum_tensors(subset)
        on_gpu = [t.cuda() for t in subset]
        assert checksum_tensors(on_gpu) == want
        assert checksum_tensors(on_gpu) == want  # the cached table gives the same
    # A transposed view at the same address and size must not reuse the contiguous tensor's table.
    square = torch.randn(64, 64, generator=gen).cuda()
    assert checksum_tensors([square.t()]) == checksum_tensors([square.t().cpu()])
    assert checksum_tensors([square]) == checksum_tensors([square.cpu()])


def test_kept_views_pack_every_push_and_still_refuse_a_changed_tensor():
    """A buffer that stays (a transport's slot): its views are built once per layout and buffer,
    every pack lands the values given, a tensor changed since the manifest is refused by name."""
    m = plan_manifest(specs_of(named()), version=1, bucket_bytes=1 << 20)
    assert len(m.buckets) == 1
    slot, other = alloc_bucket(m.buckets[0].nbytes + 64), alloc_bucket(m.buckets[0].nbytes)
    kept = BucketViews()
    first = kept.get(m, 0, slot)
    for scale in (1, 3, -2):
        state = {n: (t * scale).to(t.dtype) for n, t in named()}
        buf = pack_bucket(m, 0, state, slot, kept)
        assert all(torch.equal(v, state[n]) for n, v in bucket_views(buf, m.bucket_tensors(0)))
        assert kept.get(m, 0, slot) is first  # the same views, not built again
    on_other = kept.get(m, 0, other)
    assert on_other is not first  # another buffer: its own views
    assert kept.get(m.model_copy(update={"version": 2}), 0, other) is on_other  # a copy shares the layout
    relaid = plan_manifest(specs_of(named()), version=2, bucket_bytes=1 << 20)
    assert kept.get(relaid, 0, other) is not on_other  # a layout planned again: built again
    state = dict(named())
    state["c"] = state["c"].float()
    with pytest.raises(ValueError, match="tensor 'c' changed since the manifest was made"):
        pack_bucket(m, 0, state, slot, kept)
    kept.clear()
    assert kept.get(m, 0, slot) is not first
