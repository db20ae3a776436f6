"""`benchmarks/push_timeline`: the stamps it records in the trainer and in the receiver processes of
a real `bench weight-sync` run line up per push, and its other start order (the sender first, as
the library did before) still pushes verified bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "push_timeline"


def _run(folder: Path, **env: str) -> dict:
    environ = {**os.environ, "ROLLOUT_ENGINES_TIMELINE_DIR": str(folder), **env,
               "PYTHONPATH": os.pathsep.join([str(TOOL), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "rollout_engines", "bench", "weight-sync", "--transport", "shm", "--size-mb", "4",
           "--tensors", "32", "--repeats", "4", "--checksum", "none", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=environ)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(folder: Path) -> dict:
    out = subprocess.run([sys.executable, str(TOOL / "summarize.py"), str(folder), "--skip", "1", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("sender_first", [False, True])
def test_stamps_of_every_process_line_up_per_push(tmp_path, sender_first):
    env = {"ROLLOUT_ENGINES_TIMELINE_SENDER_FIRST": "1"} if sender_first else {}
    result = _run(tmp_path, **env)
    assert result["verified"] is True  # either order pushes the same bytes
    files = sorted(tmp_path.glob("tl.*.json"))
    assert len(files) >= 2  # the trainer and its receiver process(es)
    summary = _summary(tmp_path)
    assert summary["pushes"] == len(result["pushes"])
    ms = {label: row["median_ms"] for label, row in summary["labels"].items()}
    # the trainer's push and its sender; the receiver's own receive, in another process
    assert ms["sync.send>"] == 0.0
    assert 0 <= ms["sync.stream>"] < ms["sender.publish>"] < ms["sync.stream<"] <= ms["sync.send<"]
    assert 0 <= ms["receive>"] < ms["receiver.recv_bucket<"] <= ms["receive<"] <= ms["sync.send<"]
    assert ms["sender.publish>"] <= ms["receiver.recv_bucket<"]  # a bucket is taken after it was described
