"""`benchmarks/first_bucket_wake.py` runs on the CPU and times what it says it does."""

from __future__ import annotations

import pytest
from repo_scripts import load_script

pytestmark = pytest.mark.timeout(120)

wake = load_script("benchmarks/first_bucket_wake.py")


def test_a_receiver_ahead_of_the_sender_gets_the_first_bucket_and_its_span_is_timed():
    out = wake.measure(0.05, pushes=3)
    # publish to receive of a 4 KiB bucket in one process: positive, and far below the
    # 50 ms the receiver waited ahead (the span starts at the publish, not at the receiver's start)
    assert 0 < out["median_us"] <= out["p90_us"] < 50_000, out
