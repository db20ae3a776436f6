"""Closing one SGLang engine ends its own processes only.

SGLang's ``Engine.shutdown`` (0.5.17) ends with ``kill_process_tree(os.getpid(),
include_parent=False)``: it kills every child of the hosting process. On an H200, closing one
engine of a test module killed the detokenizer of the module's other engine, whose watchdog then
failed it. SGLang does not run on this machine, so ``sglang`` here is a **fake** module whose
``Engine`` starts a 'scheduler' child process and whose ``shutdown`` and ``kill_process_tree`` do
what SGLang's do. The real part is everything of ours: the runtime, its record of the processes
its engine started, and the shutdown that ends only those (real child processes).
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
from rollout_engines_sglang.runtime import InProcessRuntime

FAKE_ENGINE_MODULE = '''
import atexit, os, subprocess, sys, types
import psutil

def kill_process_tree(parent_pid, include_parent=True, skip_pid=None, wait_timeout=None):
    """SGLang's: kill every descendant of parent_pid (and it, if include_parent)."""
    children = psutil.Process(parent_pid).children(recursive=True)
    for child in children:
        if child.pid != skip_pid:
            child.kill()
    psutil.wait_procs(children, timeout=wait_timeout)

class Engine:
    def __init__(self, **server_kwargs):
        self.scheduler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        self.server_args = types.SimpleNamespace(tp_size=1)
        self.tokenizer_manager = types.SimpleNamespace(tokenizer=None, model_config=None)
        atexit.register(self.shutdown)

    def shutdown(self):
        kill_process_tree(os.getpid(), include_parent=False, wait_timeout=60)
'''


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])


@pytest.fixture
def fake_sglang(monkeypatch):
    names = ["sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.engine"]
    modules = [types.ModuleType(n) for n in names]
    exec(FAKE_ENGINE_MODULE, modules[-1].__dict__)
    modules[0].Engine = modules[-1].Engine
    for parent, child, name in zip(modules, modules[1:], names[1:], strict=False):
        setattr(parent, name.rsplit(".", 1)[1], child)
    for name, module in zip(names, modules, strict=True):
        monkeypatch.setitem(sys.modules, name, module)
    return modules[-1]


def test_closing_one_engine_leaves_the_others_and_the_hosts_processes(fake_sglang):
    real_kill = fake_sglang.kill_process_tree
    host = sleeper()  # the trainer's own child (a data loader worker, say)
    a = b = None
    try:
        a, b = InProcessRuntime({}), InProcessRuntime({})
        sched_a, sched_b = a._engine.scheduler, b._engine.scheduler
        assert a.processes == {sched_a.pid} and b.processes == {sched_b.pid}
        a.shutdown()
        assert sched_a.poll() is not None  # this engine's scheduler is gone
        assert sched_b.poll() is None and host.poll() is None  # the others live
        assert fake_sglang.kill_process_tree is real_kill
        b.shutdown()
        assert sched_b.poll() is not None and host.poll() is None
    finally:
        for proc in (host, *(r._engine.scheduler for r in (a, b) if r is not None)):
            proc.kill()
            proc.wait(10)


UNSENT = '''
import gc, sys, types
import zmq
from rollout_engines_sglang.runtime import close_zmq_contexts

manager = types.SimpleNamespace()  # as SGLang's tokenizer manager holds its sockets
context = zmq.Context(2)
manager.send_to_scheduler = context.socket(zmq.PUSH)
manager.send_to_scheduler.connect(sys.argv[2])
manager.send_to_scheduler.send(b"request")  # queued for a scheduler that is gone (nobody binds the endpoint)
if sys.argv[1] == "close":
    assert close_zmq_contexts(manager) == 1
del context
manager.send_to_scheduler = None  # collected later: the socket first (ZeroMQ's default linger: forever),
gc.collect()  # then its context
print("collected")
'''


@pytest.mark.parametrize("close", [True, False])
def test_sockets_left_with_unsent_messages_do_not_hang_the_collector(tmp_path, close):
    """Real ZeroMQ: a context collected after its socket with an unsent message waits forever
    (what hung a test process on the H200 after an engine's close); destroyed by the runtime's
    shutdown first, the collection returns. Bounded: the hang is cut after a few seconds."""
    pytest.importorskip("zmq")
    endpoint = f"ipc://{tmp_path / 'scheduler'}"
    cmd = [sys.executable, "-c", UNSENT, "close" if close else "leave", endpoint]
    if close:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "collected", out.stderr
    else:
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run(cmd, capture_output=True, text=True, timeout=5)
