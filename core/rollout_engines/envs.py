"""Device environment for engine processes: ``CUDA_VISIBLE_DEVICES`` and Ray bundles, in one place.

Engines pick their GPUs from environment variables that the launcher, Ray and the engine library
each want to own. Getting it wrong gives engines on the wrong GPU or several engines on one
(OpenRLHF#800, verl#2971), so every backend sets its environment through
:func:`setup_device_env` instead of its own copy of the rules.

The rules:

- ``gpu_ids`` given: ``CUDA_VISIBLE_DEVICES`` becomes exactly those ids.
- ``ray_bundle`` given (the engine runs in a Ray actor of a placement group): Ray's own
  ``CUDA_VISIBLE_DEVICES`` rewriting is switched off (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``)
  because the engine places its workers itself; then

  * workers started through Ray (``executor="ray"``, vLLM's Ray executor) must see every GPU of
    the node, so ``CUDA_VISIBLE_DEVICES`` is removed and the bundle indices and GPUs per worker
    are handed to the engine library (vLLM: ``VLLM_RAY_BUNDLE_INDICES`` /
    ``VLLM_RAY_PER_WORKER_GPUS``);
  * workers started by the engine itself (``executor="mp"`` or a single worker) see only the
    GPUs Ray assigned to the actor (``ray_bundle.gpu_ids``, from ``ray.get_gpu_ids()``).
- Nothing given: nothing changes.

The function returns the changes (a value of ``None`` means "unset") and applies them to
``environ`` (``os.environ`` by default) unless ``apply=False``, so a launcher can pass them to a
subprocess or a Ray ``runtime_env`` instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger("rollout_engines.envs")

RAY_NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class RayBundle(BaseModel):
    """Where an engine sits in a Ray placement group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bundle_indices: tuple[int, ...] = Field(description="Placement-group bundles of the engine's workers.")
    gpus_per_worker: float = Field(default=1.0, gt=0, description="Fractional when colocated with a trainer.")
    executor: Literal["ray", "mp"] = Field(
        default="ray", description="'ray': the engine starts its workers as Ray actors; 'mp': as subprocesses."
    )
    gpu_ids: tuple[int | str, ...] = Field(
        default=(), description="GPUs Ray assigned to this actor (ray.get_gpu_ids()); used with executor='mp'."
    )


#: Variables the engine libraries read for Ray bundle placement (backend name -> variable names).
_BUNDLE_VARS: dict[str, tuple[str, str]] = {
    "vllm": ("VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS"),
}


def setup_device_env(
    backend: str,
    *,
    gpu_ids: Sequence[int | str] | None = None,
    ray_bundle: RayBundle | dict | None = None,
    environ: MutableMapping[str, str] | None = None,
    apply: bool = True,
) -> dict[str, str | None]:
    """Set the device environment for an engine of ``backend``; returns the changes made.

    Call it in the process that starts the engine, before the engine library is imported.
    """
    if gpu_ids is not None and ray_bundle is not None:
        raise ValueError("give gpu_ids or ray_bundle, not both (with Ray, pass ray_bundle.gpu_ids)")
    changes: dict[str, str | None] = {}
    if gpu_ids is not None:
        if len(gpu_ids) == 0:
            raise ValueError("gpu_ids is empty; pass at least one GPU id, or None to leave the environment alone")
        changes["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
    if ray_bundle is not None:
        bundle = ray_bundle if isinstance(ray_bundle, RayBundle) else RayBundle.model_validate(ray_bundle)
        if not bundle.bundle_indices:
            raise ValueError("ray_bundle.bundle_indices is empty; name the bundle of every worker")
        changes[RAY_NOSET] = "1"
        if bundle.executor == "ray":
            changes["CUDA_VISIBLE_DEVICES"] = None
            names = _BUNDLE_VARS.get(backend)
            if names is not None:
                changes[names[0]] = ",".join(str(i) for i in bundle.bundle_indices)
                changes[names[1]] = repr(bundle.gpus_per_worker)
        else:
            if not bundle.gpu_ids:
                raise ValueError(
                    "ray_bundle.executor='mp' needs ray_bundle.gpu_ids (ray.get_gpu_ids() in the actor)"
                )
            changes["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in bundle.gpu_ids)
    if apply and changes:
        env = os.environ if environ is None else environ
        for key, value in changes.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        logger.debug("device environment for %s: %s", backend, changes)
    return changes


@contextlib.contextmanager
def launch_env(changes: Mapping[str, str | None]) -> Iterator[None]:
    """Apply ``changes`` (from ``setup_device_env(..., apply=False)``) only while an engine starts
    its worker processes, then restore the caller's environment.

    For engines started inside a process that already uses CUDA (a colocated trainer): the workers
    inherit the new ``CUDA_VISIBLE_DEVICES`` at start, while the caller's own device numbering, fixed
    when it initialised CUDA, must not change under it.
    """
    saved = {key: os.environ.get(key) for key in changes}
    try:
        for key, value in changes.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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
            "this process. Call rollout_engines.envs.install_child_failure_guard() on the main thread "
            "first, or create the engine there"
        )

    def unregister() -> None:
        if callback in _child_failure_callbacks:
            _child_failure_callbacks.remove(callback)

    return unregister
