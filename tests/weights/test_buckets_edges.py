"""Bucket checksums and packing at their edges: tensors at any byte offset, odd sizes, bool and
float8, zero-size tensors."""

from __future__ import annotations

import torch
from rollout_engines.weights.buckets import bucket_views, checksum, checksum_tensors, pack_bucket
from rollout_engines.weights.manifest import plan_manifest, specs_of


def test_zero_copy_checksum_of_views_at_any_byte_offset():
    """A zero-copy bucket's tensors are the trainer's own: views of a flat buffer may start a few
    bytes past a word. Their checksum is that of their bytes (as of a copy), not an error."""
    flat = torch.arange(1, 3000, dtype=torch.float32).bfloat16()
    for algo in ("pos64", "sum64"):
        for start in range(0, 9):
            views = [flat[start : start + 1000].view(10, 100), flat[start + 1001 : start + 1006]]
            assert checksum_tensors(views, algo) == checksum_tensors([v.clone() for v in views], algo), (algo, start)
    raw = torch.arange(300, dtype=torch.uint8)
    for algo in ("pos64", "sum64"):
        assert checksum(raw[3:], algo) == checksum(raw[3:].clone(), algo)


def test_pack_unpack_odd_sizes_bool_float8_and_empty_bit_exact():
    gen = torch.Generator().manual_seed(0)
    named = {
        "flags": torch.rand(37, generator=gen) > 0.5,
        "f8": torch.randn(3, 5, generator=gen).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 4),
        "h": torch.tensor([-0.0, float("nan"), 1.0], dtype=torch.float16),
        "w": torch.randn(7, 3, generator=gen, dtype=torch.float64).t(),  # non-contiguous
        "b": torch.randn(11, generator=gen).bfloat16(),
    }
    manifest = plan_manifest(specs_of(list(named.items())), version=1, bucket_bytes=512)
    for bucket in manifest.buckets:
        out = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)
        buf = pack_bucket(manifest, bucket.index, named, out)
        for name, view in bucket_views(buf, manifest.bucket_tensors(bucket.index)):
            want = named[name]
            assert view.dtype == want.dtype and view.shape == want.shape, name
            assert torch.equal(view.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), name
        corrupt = buf.clone()
        corrupt[-1] ^= 1
        assert checksum(corrupt) != checksum(buf)
