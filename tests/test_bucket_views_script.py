"""`benchmarks/bucket_views.py`: both ways of viewing a bucket are timed on the same views."""

from __future__ import annotations

import json

from repo_scripts import load_script

bucket_views = load_script("benchmarks/bucket_views.py")


def test_the_script_times_both_ways_on_the_same_views(capsys):
    result = bucket_views.main(["--tensors", "300", "--repeats", "2"])
    assert json.loads(capsys.readouterr().out) == result
    assert result["tensors"] == 300 and result["same_views"] is True
    assert result["bucket_views_ms"] > 0 and result["plain_ms"] > 0
    # the ratio is of the unrounded times
    assert abs(result["ratio"] - result["plain_ms"] / result["bucket_views_ms"]) <= 0.05 * result["ratio"] + 0.01
