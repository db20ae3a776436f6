"""Stamps of a weight push's path in every process, for `bench push` and `bench weight-sync`.

Put this folder first on ``PYTHONPATH`` and name an output folder; every Python process started
with that environment (the trainer, vLLM's engine core and workers) then records, for the
functions below, when each call started (``label>``) and ended (``label<``), on
``time.perf_counter_ns`` (the system-wide monotonic clock on Linux, so stamps of different
processes compare), and writes ``tl.<pid>.json`` into the folder at exit::

    ROLLOUT_ENGINES_TIMELINE_DIR=/tmp/tl PYTHONPATH=benchmarks/push_timeline \
        rollout-engines bench push --backend vllm ... --json
    python benchmarks/push_timeline/summarize.py /tmp/tl

``ROLLOUT_ENGINES_TIMELINE_SENDER_FIRST=1`` starts a push's halves in the order the library
used before: the trainer's sender thread at once, beside the engines' receives (the library now
lets the receives take their first step first), to measure what the order costs. A diagnostic
only: it wraps functions of the installed library at import and changes nothing else.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

OUT_DIR = os.environ.get("ROLLOUT_ENGINES_TIMELINE_DIR")
_stamps: list[tuple[str, int, str]] = []


def stamp(label: str) -> None:
    _stamps.append((label, time.perf_counter_ns(), threading.current_thread().name))


def _dump() -> None:
    if OUT_DIR and _stamps:
        with open(os.path.join(OUT_DIR, f"tl.{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv[:2], "stamps": _stamps}, f)


def wrap(owner: Any, attr: str, label: str) -> None:
    fn = owner.__dict__.get(attr)
    if fn is None or getattr(fn, "_timeline", False):
        return
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped(*a: Any, **k: Any) -> Any:
            stamp(label + ">")
            try:
                return await fn(*a, **k)
            finally:
                stamp(label + "<")
    else:
        @functools.wraps(fn)
        def wrapped(*a: Any, **k: Any) -> Any:
            stamp(label + ">")
            try:
                return fn(*a, **k)
            finally:
                stamp(label + "<")
    wrapped._timeline = True  # type: ignore[attr-defined]
    setattr(owner, attr, wrapped)


def _classes(module: Any) -> list[type]:
    return [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]


def _session(m: Any) -> None:
    if os.environ.get("ROLLOUT_ENGINES_TIMELINE_SENDER_FIRST") == "1":
        m.SENDER_START_WAIT_S = 0.0  # the sender's thread, started first, begins at once
    for attr in ("push", "_send", "_stream"):
        wrap(m.WeightSync, attr, f"sync.{attr.strip('_')}")


def _doorbell(m: Any) -> None:
    for attr in ("ring", "_post", "_answers"):
        wrap(m.Doorbell, attr, f"bell.{attr.strip('_')}")
    wrap(m.DoorbellListener, "_answer", "listener.answer")


def _slots(m: Any) -> None:
    for attr in ("_publish", "end"):
        wrap(m.SlotSender, attr, f"sender.{attr.strip('_')}")
    for attr in ("begin", "recv_bucket", "end"):
        wrap(m.SlotReceiver, attr, f"receiver.{attr}")


def _receiver(m: Any) -> None:
    wrap(m.WeightReceiver, "_receive_into", "receive")


def _by_name(*attrs: str) -> Callable[[Any], None]:
    def patch(m: Any) -> None:
        for cls in _classes(m):
            for attr in attrs:
                wrap(cls, attr, f"{cls.__name__}.{attr.strip('_')}")
    return patch


PATCHES: dict[str, Callable[[Any], None]] = {
    "rollout_engines.weights.session": _session,
    "rollout_engines.weights.doorbell": _doorbell,
    "rollout_engines.weights.transports._slots": _slots,
    "rollout_engines.weights.receiver": _receiver,
    "rollout_engines.weights.transports.cuda_ipc": _by_name("share_tensors", "send_shared", "begin", "_open_shared"),
    "rollout_engines.weights.transports._cuda_segments": _by_name("describe", "views"),
    "rollout_engines.weights.copy_plan": _by_name("replay"),
    "rollout_engines.engine": _by_name("receive_weights"),
    "rollout_engines_vllm.engine": _by_name("_receive_weights"),
    "rollout_engines_vllm.worker_ext": _by_name("_roe_receive"),
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[Any], None]) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, patch)
        return spec


if OUT_DIR:
    sys.meta_path.insert(0, _Finder())
    atexit.register(_dump)
