"""A start-up that never finishes is bounded (option ``start_timeout_s``).

SGLang's ``Engine`` waits for its schedulers for as long as they live (seen on an H200: a
float32 engine with deterministic inference that did not come up in minutes). SGLang does not
run on this machine, so ``sglang`` here is a **fake** module whose ``Engine`` does what SGLang's
does while waiting: it starts a scheduler process and waits, polling, until the scheduler reports
ready or dies. The real part is everything of ours: the runtime's loop thread, the timeout, and
stopping the processes the start created (real child processes).
"""

from __future__ import annotations

import subprocess
import sys
import time
import types

import pytest
from rollout_engines.errors import EngineUnavailable
from rollout_engines_sglang.runtime import InProcessRuntime


class HangingEngine:
    """Fake ``sglang.Engine``: a 'scheduler' that never becomes ready; raises once it died."""

    started: list[subprocess.Popen] = []

    def __init__(self, **server_kwargs):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        HangingEngine.started.append(proc)
        while proc.poll() is None:  # SGLang: poll(timeout=5.0), then check is_alive()
            time.sleep(0.05)
        raise RuntimeError(f"Rank 0 scheduler died with exit code {proc.returncode}")


@pytest.fixture
def fake_sglang(monkeypatch):
    module = types.ModuleType("sglang")
    module.Engine = HangingEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang", module)
    HangingEngine.started.clear()
    yield
    for proc in HangingEngine.started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_start_that_hangs_fails_in_bounded_time_and_stops_its_processes(fake_sglang):
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailable, match="start_timeout_s"):
        InProcessRuntime({"model_path": "/m"}, start_timeout_s=3.0)
    elapsed = time.monotonic() - t0
    assert len(HangingEngine.started) == 1
    scheduler = HangingEngine.started[0]
    assert scheduler.poll() is not None, "the scheduler the start created must be stopped"
    assert 3.0 <= elapsed < 20, elapsed


def test_other_processes_of_ours_are_left_alone(fake_sglang):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        with pytest.raises(EngineUnavailable):
            InProcessRuntime({"model_path": "/m"}, start_timeout_s=3.0)
        assert bystander.poll() is None, "a process started before the engine is not the engine's"
    finally:
        bystander.kill()
        bystander.wait()
