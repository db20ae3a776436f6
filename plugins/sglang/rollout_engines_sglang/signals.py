"""SGLang's worker-failure signal, kept from ending the process that hosts the engine.

SGLang's worker processes send their parent ``SIGQUIT`` when they fail. SGLang's own handler kills
the parent's whole process tree, and without any handler the signal's default action ends the
process: either way a trainer hosting the engine dies with it. The engine starts SGLang off the
main thread (so SGLang installs nothing) and registers a callback here instead.

Only the main thread can install a signal handler. :func:`install_child_failure_guard` is the
backend's ``main_thread_setup`` (see its ``BackendEntry``): a host that will create SGLang engines
from other threads (a test harness's loop thread) calls it on the main thread first; the pytest
plugin does so for tests marked ``sglang``. Nothing is installed in a process that never asks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("rollout_engines.sglang")

_child_failure_callbacks: list[Callable[[], None]] = []


def install_child_failure_guard() -> bool:
    """Install the ``SIGQUIT`` handler of :func:`guard_child_failure_signal` now (main thread only;
    returns whether it is installed). Call it early on the main thread when engines will be created
    from other threads (an event loop's worker thread, a test harness): signal handlers can only
    be installed from the main thread. While no engine is registered the handler does what the
    previous one did (by default: end the process), so Ctrl-\\ keeps working."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return getattr(signal.getsignal(signal.SIGQUIT), "__name__", "") == "_on_child_failure"
    previous = signal.getsignal(signal.SIGQUIT)
    if getattr(previous, "__name__", "") == "_on_child_failure":
        return True

    def _on_child_failure(signum: int, frame: Any) -> None:
        callbacks = list(_child_failure_callbacks)
        if not callbacks:  # no engine to protect: the signal's previous handling
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signal.SIGQUIT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGQUIT)
            return
        logger.error("SIGQUIT: an engine worker process failed")
        for cb in callbacks:
            try:
                cb()
            except Exception:  # one engine's callback must not stop the others'
                logger.exception("child-failure callback failed")

    signal.signal(signal.SIGQUIT, _on_child_failure)
    return True


def guard_child_failure_signal(callback: Callable[[], None]) -> Callable[[], None]:
    """Route ``SIGQUIT`` (what SGLang's worker processes send their parent when they fail) to
    ``callback`` instead of killing the process.

    SGLang's own handler kills the parent's whole process tree, and without any handler the
    signal's default action ends the process: either way a trainer hosting the engine dies with it.
    Engines start SGLang off the main thread (so SGLang installs nothing) and register here; the
    handler calls every registered callback. Returns a function that unregisters ``callback``.
    Outside the main thread nothing can be installed (see :func:`install_child_failure_guard`): the
    callback is registered, and a warning says the signal stays at its current handling.
    """
    _child_failure_callbacks.append(callback)
    if not install_child_failure_guard():
        logger.warning(
            "not on the main thread: cannot install the SIGQUIT guard; a failing engine worker may end "
            "this process. Call rollout_engines_sglang.signals.install_child_failure_guard() on the main thread "
            "first, or create the engine there"
        )

    def unregister() -> None:
        if callback in _child_failure_callbacks:
            _child_failure_callbacks.remove(callback)

    return unregister
