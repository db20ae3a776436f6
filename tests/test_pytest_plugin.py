"""The pytest plugin installs nothing process-wide (no signal handler) unless a collected test is
marked with a backend whose ``BackendEntry.main_thread_setup`` asks for it; then it runs once, on
the main thread. Run in a child pytest, with a fixture plugin (fake dist-info) on its path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "plugin_fixtures" / "mainthread"

CHECK = """
import signal
import pytest

def _handlers():
    out = {}
    for s in (signal.SIGQUIT, signal.SIGUSR2):
        h = signal.getsignal(s)
        out[s.name] = "default" if h == signal.SIG_DFL else getattr(h, "__name__", repr(h))
    return out

def test_plain():
    assert _handlers() == {"SIGQUIT": "default", "SIGUSR2": "default"}, _handlers()
"""

MARKED = """
@pytest.mark.mainthread
def test_marked():
    assert _handlers() == {"SIGQUIT": "default", "SIGUSR2": "_on_usr2"}, _handlers()
"""


def _pytest(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_child.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
        preexec_fn=_default_signals,  # what the child finds is then the plugin's doing, not the caller's shell's
    )


def _default_signals() -> None:
    """The child starts with default handlers (a shell starting a job in the background leaves
    SIGQUIT ignored in it, and everything it starts)."""
    import signal

    for s in (signal.SIGQUIT, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)


def test_nothing_is_installed_when_no_backend_asks(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, CHECK)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_a_marked_backend_gets_its_main_thread_setup(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, CHECK.replace("def test_plain", "def _unused") + MARKED)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
