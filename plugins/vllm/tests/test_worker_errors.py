"""Worker results come back from collective_rpc as dicts; the driver turns them into the typed
errors the core documents (the payloads here are what the worker extension returns)."""

from __future__ import annotations

import pytest
from rollout_engines.errors import ManifestMismatch, WeightsInvalidated, WeightSyncError

pytestmark = pytest.mark.vllm

OK = {"ok": True, "version": 3}
LOST = {"ok": False, "error": "WeightSyncError", "message": "gloo: no bucket within 60 s; peer: trainer (rank 0); bucket: 2",
        "peer": "trainer (rank 0)", "bucket": 2}
MISMATCH = {"ok": False, "error": "ManifestMismatch", "message": "unknown tensor 'x'", "peer": None, "bucket": None}
CRASH = {"ok": False, "error": "RuntimeError", "message": "boom", "peer": None, "bucket": None}


def raised(results, **kw):
    from rollout_engines_vllm.worker_ext import raise_worker_error

    with pytest.raises(WeightSyncError) as info:
        raise_worker_error(results, "weight update v3", **kw)
    return info.value


def test_all_ok_raises_nothing():
    from rollout_engines_vllm.worker_ext import raise_worker_error

    raise_worker_error([OK, OK], "weight update v3", update=True)


def test_lost_peer_keeps_peer_and_bucket():
    err = raised([LOST], update=True)
    assert type(err) is WeightSyncError
    assert (err.peer, err.bucket) == ("trainer (rank 0)", 2)
    assert str(err).count("peer:") == 1  # not repeated by the driver


def test_one_worker_applied_one_failed_invalidates_the_engine():
    err = raised([OK, LOST], update=True)
    assert isinstance(err, WeightsInvalidated) and "workers [0] applied it" in str(err)


def test_failed_connect_of_one_worker_is_not_an_invalid_engine():
    assert type(raised([OK, LOST], update=False)) is WeightSyncError


def test_mismatch_stays_a_mismatch_and_other_errors_name_the_worker():
    assert type(raised([MISMATCH, MISMATCH], update=True)) is ManifestMismatch
    err = raised([OK, CRASH])
    assert "vLLM worker 1: RuntimeError: boom" in str(err)


def test_the_weights_fingerprint_sums_large_tensors_in_chunks():
    """The fingerprint behind ``diagnostics(fingerprint=True)`` sums each parameter in chunks (a
    14B-shape embedding in float64 did not fit beside the engine and the trainer's weights on an
    80 GB GPU); chunked, it is the whole tensors' float64 sums."""
    import torch
    from rollout_engines_vllm.worker_ext import parameter_sums

    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(1000, 7, generator=gen).to(torch.bfloat16), torch.randn(3, generator=gen)]
    whole = [p.double() for p in params]
    sums = parameter_sums(params, chunk=64)  # 110 chunks of the first, one of the second
    assert sums["numel"] == 7003
    assert sums["sum"] == pytest.approx(sum(float(w.sum()) for w in whole), rel=1e-12, abs=1e-9)
    assert sums["abs_sum"] == pytest.approx(sum(float(w.abs().sum()) for w in whole), rel=1e-12)
    assert parameter_sums(params) == pytest.approx(sums, rel=1e-12, abs=1e-9)
