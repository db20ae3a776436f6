"""`rollout-engines bench push` end to end on the embedded backend: the pushes it times really land."""

from __future__ import annotations

import pytest


@pytest.mark.transformers
def test_push_benchmark_times_pushes_that_land(tiny_model):
    from rollout_engines.bench.push import run

    result = run({"backend": "transformers", "model": str(tiny_model), "pushes": 3, "transport": "shm",
                  "bucket_mb": 1, "option": ["dtype=\"float32\""]})
    assert result["perturbed_push_changed_weights"] is True
    assert result["original_push_restored_weights"] is True
    assert result["tensors"] > 10 and result["bytes"] > 1_000_000
    assert result["phases_median_s"]["push"] == pytest.approx(result["push_s"], rel=0.5)
