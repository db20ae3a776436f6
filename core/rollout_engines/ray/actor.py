"""The Ray actor that hosts one engine of any backend (``create_engine(config)`` inside the actor).

This module imports no Ray: :func:`rollout_engines.ray.engine.create_ray_engine` turns
:class:`EngineActor` into an actor class with ``ray.remote``. The actor serves its engine through
an :class:`~rollout_engines.proxy.EngineHost`: one generic :meth:`EngineActor.call` carries every
method of the engine protocol (and the stream cursor), so nothing here changes when the protocol
grows. Every method is async, so Ray runs the actor on an event loop and calls overlap (generate
requests are batched by the engine).
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from ..proxy import EngineHost, WireError, load_factory
from ..types import EngineConfig

#: Environment variables an actor reports in :meth:`EngineActor.describe` (device placement).
REPORTED_ENV = ("CUDA_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
                "VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS")


class EngineActor:
    """Hosts ``create_engine(config)`` (or ``factory``, ``"pkg.module:callable"``); a restart by
    Ray's policy runs this again (fresh engine)."""

    def __init__(self, config: EngineConfig, ray_bundle: dict[str, Any] | None = None,
                 factory: str | None = None) -> None:
        # A new id per start, so a proxy can tell a restarted actor from the one it knew.
        self.incarnation = uuid.uuid4().hex[:12]
        #: The first start's failure as a WireError dict (the actor then serves nothing else).
        self.start_error: dict[str, Any] | None = None
        try:
            self._start(config, ray_bundle, factory)
        except Exception as exc:
            import ray

            if ray.get_runtime_context().was_current_actor_reconstructed:
                raise  # a restart that fails: the actor dies, its proxy raises EngineUnavailable
            # Ray would carry this as ActorDiedError, or not at all when the class does not unpickle
            # (UnknownBackend): keep it for the caller in the one error wire format instead.
            self.start_error = WireError.of(exc).model_dump()

    def _start(self, config: EngineConfig, ray_bundle: dict[str, Any] | None, factory: str | None) -> None:
        if ray_bundle is not None:
            import ray

            from ..envs import setup_device_env

            # Before the engine library is imported: the engine places its own workers (see envs).
            bundle = dict(ray_bundle)
            if bundle.get("executor") == "mp" and not bundle.get("gpu_ids"):
                bundle["gpu_ids"] = tuple(ray.get_gpu_ids())
            setup_device_env(config.backend, ray_bundle=bundle)
        self.engine = load_factory(factory)(config)
        self.host = EngineHost(self.engine)

    async def describe(self) -> dict[str, Any]:
        """What the actor hosts, or ``{"start_error": WireError dict}`` when its engine did not start."""
        import ray

        if self.start_error is not None:
            return {"start_error": self.start_error}
        return {
            **self.host.describe(),
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "env": {k: os.environ.get(k) for k in REPORTED_ENV},
        }

    async def call(self, method: str, args: dict[str, Any]) -> tuple[bool, Any]:
        """One call of the engine protocol: ``(True, wire result)`` or ``(False, WireError dict)``."""
        if self.start_error is not None:
            return False, self.start_error
        ok, out = await self.host.reply(method, args)
        if ok and method == "info":
            out["extra"] = {**out.get("extra", {}), "incarnation": self.incarnation, "pid": os.getpid()}
        return ok, out
