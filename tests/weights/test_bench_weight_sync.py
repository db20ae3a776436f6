"""`rollout-engines bench weight-sync ... --json` through the real command line: receiver processes,
the JSON fields the issue names, and the pushed bytes verified in every receiver."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.timeout(300)


def _bench(*extra: str) -> dict:
    cmd = [sys.executable, "-m", "rollout_engines", "bench", "weight-sync", "--size-mb", "4", "--tensors", "32",
           "--repeats", "2", "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "_stderr": out.stderr}


@pytest.mark.parametrize("extra", [(), ("--receive-thread",)])
def test_shm_bench_reports_a_verified_ratio(extra):
    r = _bench("--transport", "shm", *extra)
    assert r["transport"] == "shm" and r["tensors"] == 32 and r["bytes"] == 32 * (4 * 2**20 // 4 // 32) * 4
    assert r["verified"] is True  # every receiver's tensors sum to the trainer's
    assert r["receive_on"] == ("thread" if extra else "loop")
    assert r["baseline_kind"] == "memcpy" and r["baseline"] > 0
    assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline"], abs=0.002)
    assert r["seconds"] == min(r["pushes"][1:]) and len(r["pushes"]) == 3
    # the host's Python speed, sampled beside each baseline (3 pushes: 3 samples)
    speed = r["host_loop_us"]
    assert set(speed) == {"median", "min", "max"} and 0 < speed["min"] <= speed["median"] <= speed["max"]
    # both sides' account of the last push: the trainer's stream and the receiver's own timings
    sent, got = r["sender_timings_last_push"], r["receiver_timings_last_push"]
    assert 0 < sent["first_bucket"] <= sent["stream"] <= r["pushes"][-1]
    assert 0 < got["apply"] <= got["total"] <= r["pushes"][-1]
    # the receivers let go of the trainer's store before it closes: no failed store reads at the
    # end (the store's client logs those with a C++ stack), and no timed-out store waits
    assert "recvValue failed" not in r["_stderr"] and "waitForInput" not in r["_stderr"], r["_stderr"][-2000:]


def test_a_named_shape_pushes_that_models_bf16_tensors():
    from rollout_engines.testing.shapes import SHAPES, tensor_shapes

    r = _bench("--transport", "shm", "--shape", "tiny")
    shapes = tensor_shapes(SHAPES["tiny"], qwen3=False)
    assert r["shape"] == "tiny" and r["tensors"] == len(shapes) and r["verified"] is True
    assert r["bytes"] == sum(2 * torch.Size(s).numel() for _, s in shapes)  # bf16


def test_gloo_bench_to_two_receivers_compares_with_a_raw_broadcast():
    r = _bench("--transport", "gloo", "--receivers", "2", "--checksum", "none")
    assert r["receivers"] == 2 and r["verified"] is True and r["checksum"] == "none"
    assert r["raw_broadcast_gbps"] > 0
    assert r["ratio_vs_raw"] == pytest.approx(r["gbps"] / r["raw_broadcast_gbps"], abs=0.002)
