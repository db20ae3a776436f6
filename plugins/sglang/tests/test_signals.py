"""SGLang's failing workers SIGQUIT their parent; the engine's guard keeps the parent alive."""

from __future__ import annotations

GUARD_SCRIPT = """
import os, signal, threading, time
from rollout_engines_sglang.signals import guard_child_failure_signal, install_child_failure_guard

hits = []
assert install_child_failure_guard()
box = {}
# An engine created on a loop thread registers there (where no handler can be installed).
t = threading.Thread(target=lambda: box.setdefault("unregister", guard_child_failure_signal(lambda: hits.append(1))))
t.start(); t.join()
os.kill(os.getpid(), signal.SIGQUIT)
time.sleep(0.2)
print("survived", hits, flush=True)
box["unregister"]()
os.kill(os.getpid(), signal.SIGQUIT)  # no engine left: the default action ends the process
time.sleep(2)
print("still alive", flush=True)
"""


def test_sigquit_guard_protects_while_an_engine_is_registered_and_not_after():
    """SGLang's failing workers SIGQUIT their parent: with an engine registered (even from another
    thread) the trainer survives and the engine hears of it; with none, SIGQUIT acts as before."""
    import signal
    import subprocess
    import sys

    # From SIGQUIT's default action, whatever the caller left (a shell's background job has it ignored).
    proc = subprocess.run([sys.executable, "-c", GUARD_SCRIPT], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGQUIT, signal.SIG_DFL))
    assert "survived [1]" in proc.stdout, proc.stderr
    assert "still alive" not in proc.stdout
    assert proc.returncode == -signal.SIGQUIT


def test_the_backend_asks_for_its_guard_on_the_main_thread():
    """The registration names the guard as the backend's main-thread setup (what the pytest plugin
    and other hosts call before they create engines off the main thread)."""
    from rollout_engines.plugins import get_registry
    from rollout_engines_sglang import signals

    spec = get_registry().backends["sglang"].spec
    assert spec is not None and spec.load_main_thread_setup() is signals.install_child_failure_guard
