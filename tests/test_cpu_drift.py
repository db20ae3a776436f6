"""`benchmarks/cpu_drift.py`: the host-CPU probe runs anywhere and reports what it says it does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from repo_scripts import load_script

cpu_drift = load_script("benchmarks/cpu_drift.py")


def test_probe_reports_each_pause_and_the_spread_over_rounds(capsys):
    result = cpu_drift.main(["--pauses", "0,0.02", "--rounds", "2", "--repeats", "2"])
    assert json.loads(capsys.readouterr().out) == result
    assert len(result["rounds"]) == 2
    for r in result["rounds"]:
        assert r["hot_loop_us"] > 0
        assert len(r["after_0s_loop_us"]) == 3 and len(r["after_0.02s_loop_us"]) == 3
        assert all(v > 0 for v in r["after_0.02s_loop_us"])
        assert r["thread_wake_us"]["back_to_back"] > 0 and r["thread_wake_us"]["after_0.02s"] > 0
    hot = [r["hot_loop_us"] for r in result["rounds"]]
    assert result["hot_loop_us_min"] == min(hot) and result["hot_loop_us_max"] == max(hot)


def test_a_negative_pause_is_a_usage_error():
    proc = subprocess.run([sys.executable, cpu_drift.__file__, "--pauses", "0.1,-1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--pauses must be seconds >= 0" in proc.stderr


@pytest.mark.parametrize("n", [1000, 5000])
def test_the_loop_takes_longer_for_more_work(n):
    from rollout_engines.bench.common import python_loop_s

    short = min(python_loop_s(n) for _ in range(5))
    longer = min(python_loop_s(n * 20) for _ in range(5))
    assert longer > short


def test_host_speed_reports_median_fastest_and_slowest():
    from rollout_engines.bench.common import host_speed

    assert host_speed([0.0009, 0.0004, 0.0006]) == {"median": 600.0, "min": 400.0, "max": 900.0}
    assert host_speed([0.0004, 0.0006]) == {"median": 500.0, "min": 400.0, "max": 600.0}
    assert host_speed([]) == {}
