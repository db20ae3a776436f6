"""A plugin whose backend asks for a main-thread setup (as SGLang's does for its SIGQUIT guard),
used by the pytest-plugin tests (loaded from a fake dist-info)."""
import signal
import threading

from rollout_engines import BackendEntry, hookimpl


def _on_usr2(signum, frame):
    pass


def install():
    """Installs a SIGUSR2 handler: only the main thread may."""
    assert threading.current_thread() is threading.main_thread()
    signal.signal(signal.SIGUSR2, _on_usr2)


@hookimpl
def register_backends(register):
    register(BackendEntry(name="mainthread", target="rollout_engines.backends.transformers.engine:TransformersEngine",
                         install_hint='pip install "roe-mainthread"', main_thread_setup="roe_mainthread:install"))
