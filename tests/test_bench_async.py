"""`rollout-engines bench async` through the real command line, on the transformers backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(300)]


def test_bench_async_cli(tiny_model):
    cmd = [sys.executable, "-m", "rollout_engines", "bench", "async", "--backend", "transformers",
           "--model", str(tiny_model), "--requests", "24", "--concurrency", "4", "--step-requests", "6",
           "--max-tokens", "12", "--aborts", "6", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "transformers" and result["transport"] == "inproc"
    assert result["tokens_per_s_no_push"] > 0 and result["tokens_per_s_push"] > 0
    assert result["pushes"] >= 2
    assert result["idle_source"] == "engine info()"
    assert 0.0 <= result["idle_fraction"] <= 1.0 and 0.0 <= result["idle_fraction_no_push"] <= 1.0
    assert result["aborts"] == 6
    assert 0 < result["abort_ms_median"] <= result["abort_ms_p99"] < 5000
