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
    are handed to the engine library in the variables it reads, which the backend names through
    its ``BackendEntry.ray_bundle_env`` (vLLM: ``VLLM_RAY_BUNDLE_INDICES`` /
    ``VLLM_RAY_PER_WORKER_GPUS``); the core knows no engine library's variables;
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
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Literal

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


def _ray_bundle_env(backend: str, bundle: RayBundle) -> dict[str, str]:
    """The engine library's own variables for workers it starts through Ray, from the backend's
    ``BackendEntry.ray_bundle_env`` (none where the backend is not installed or names none)."""
    from .plugins import get_registry

    record = get_registry().backends.get(backend)
    if record is None or record.spec is None or record.spec.ray_bundle_env is None:
        return {}
    return dict(record.spec.load_ray_bundle_env()(bundle))


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
            changes.update(_ray_bundle_env(backend, bundle))
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
