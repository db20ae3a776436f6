"""`rollout-engines bench refit` through the real command line, on the transformers backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(300)]

PHASES = ("sleep", "wake_weights", "push", "wake_kv", "push_and_kv", "first_token", "refit")


def _bench(*extra):
    cmd = [sys.executable, "-m", "rollout_engines", "bench", "refit", "--backend", "transformers", *extra, "--json"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=280)


def test_bench_refit_cli(tiny_model):
    proc = _bench("--model", str(tiny_model), "--cycles", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "transformers" and result["sleep_level"] == 2 and result["cycles"] == 2
    assert result["warmup_pushes"] == 4  # untimed pushes before the cycles
    assert result["trainer_sets"] == 2
    for key in ("median_s", "p90_s", "first_cycle_s"):
        assert set(result[key]) == set(PHASES)
        assert all(v >= 0 for v in result[key].values())
    med = result["median_s"]
    assert med["refit"] == pytest.approx(med["wake_weights"] + med["push"] + med["wake_kv"], abs=1e-5)
    assert med["push_and_kv"] == pytest.approx(med["push"] + med["wake_kv"], abs=1e-5)
    assert result["overlap_kv"] is False
    assert result["bytes"] > 0 and result["push_gbps"] > 0
    phases = result["push_phases_median_s"]  # the engine's own account of each cycle's push
    assert phases["push"] == pytest.approx(med["push"], abs=1e-5) and 0 < phases["worker_total"] <= phases["push"]
    assert result["verified"] is True and result["pushes_verified"] == [True, True]
    assert result["sleep_freed_gb"] is None and result["freed_at_wake_gb"] is None  # no GPU, nothing read
    assert result["trainer_step"] is False and result["trainer_step_gb"] is None  # no --trainer-step


def test_bench_refit_from_one_set_of_tensors(tiny_model):
    """``--one-set``: each cycle pushes the trainer's one set, rewritten before the cycle; every
    push is still verified (the perturbed set changed the outputs, the originals restored them)."""
    proc = _bench("--model", str(tiny_model), "--cycles", "3", "--one-set")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["trainer_sets"] == 1
    assert result["verified"] is True and result["pushes_verified"] == [True, True, True, True]


def test_bench_refit_overlapping_the_kv_wake_up(tiny_model):
    """``--overlap-kv``: the KV cache wakes while the push runs; every push still lands (verified),
    and the pair's time covers each call's own."""
    proc = _bench("--model", str(tiny_model), "--cycles", "2", "--overlap-kv")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["overlap_kv"] is True
    assert result["verified"] is True and result["pushes_verified"] == [True, True]
    med = result["median_s"]
    assert med["refit"] == pytest.approx(med["wake_weights"] + med["push_and_kv"], abs=1e-5)
    assert med["push_and_kv"] >= max(med["push"], med["wake_kv"]) - 1e-5


def test_bench_refit_idles_between_sleep_and_wake_up(tiny_model):
    """``--idle-s``: each cycle waits between its sleep and its wake-up (the trainer's step), outside
    the timed phases; every push still lands."""
    proc = _bench("--model", str(tiny_model), "--cycles", "2", "--idle-s", "0.2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["idle_s"] == 0.2
    assert result["verified"] is True and result["pushes_verified"] == [True, True]
    # the tiny model wakes in milliseconds: the idle is in no cycle's wake_weights
    assert result["median_s"]["wake_weights"] < 0.15 and result["first_cycle_s"]["wake_weights"] < 0.15


def test_bench_refit_runs_a_trainer_step_in_the_memory_each_sleep_freed(tiny_model):
    """``--trainer-step``: after each sleep a trainer's step takes memory (without a GPU, the
    weights' bytes), writes it and frees it, outside the timed phases; every push still lands."""
    proc = _bench("--model", str(tiny_model), "--cycles", "2", "--trainer-step")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["trainer_step"] is True
    assert result["trainer_step_gb"] == round(result["bytes"] / 1e9, 3) > 0
    assert result["verified"] is True and result["pushes_verified"] == [True, True]


def test_bench_refit_serves_between_cycles(tiny_model):
    """``--serve-s``: the engine stays awake before each cycle's sleep (the rollouts between two
    refits), outside the timed phases; the run takes at least that long per cycle, every push still
    lands."""
    import time

    t0 = time.perf_counter()
    proc = _bench("--model", str(tiny_model), "--cycles", "2", "--serve-s", "0.5")
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["serve_s"] == 0.5 and result["idle_s"] == 0.0
    assert result["verified"] is True and result["pushes_verified"] == [True, True]
    assert wall >= 2 * 0.5
    assert all(v < 0.5 for v in result["first_cycle_s"].values())  # the pause is in no timed phase


def test_bench_refit_refuses_a_negative_idle(tiny_model):
    from rollout_engines.bench.refit import run

    with pytest.raises(ValueError, match=r"--idle-s must be >= 0, got -0\.5"):
        run({"backend": "transformers", "model": str(tiny_model), "idle_s": -0.5})
    with pytest.raises(ValueError, match=r"--serve-s must be >= 0, got nan"):
        run({"backend": "transformers", "model": str(tiny_model), "serve_s": float("nan")})
    for flag, bad, message in (("--idle-s", "-1", "--idle-s must be >= 0, got -1.0"),
                               ("--idle-s", "soon", "--idle-s wants seconds, got 'soon'"),
                               ("--serve-s", "-2", "--serve-s must be >= 0, got -2.0")):
        proc = _bench("--model", str(tiny_model), flag, bad)  # a usage error before any engine starts
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_bench_refit_unsupported_level(tiny_model):
    proc = _bench("--model", str(tiny_model), "--level", "3")
    assert proc.returncode == 2
    assert "supported levels: 1, 2" in proc.stderr
