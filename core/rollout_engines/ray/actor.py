"""The Ray actor that hosts one engine of any backend (``create_engine(config)`` inside the actor).

This module imports no Ray: :func:`rollout_engines.ray.engine.create_ray_engine` turns
:class:`EngineActor` into an actor class with ``ray.remote``. Every method is async, so Ray runs
the actor on an event loop and calls overlap (generate requests are batched by the engine).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence
from typing import Any

from ..types import Completion, EngineConfig, EngineInfo, GenerateRequest, PauseMode
from ..weights.manifest import TransportSpec, WeightManifest

#: Environment variables an actor reports in :meth:`EngineActor.describe` (device placement).
REPORTED_ENV = ("CUDA_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
                "VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS")


class EngineActor:
    """Hosts ``create_engine(config)``; a restart by Ray's policy runs this again (fresh engine)."""

    def __init__(self, config: EngineConfig, ray_bundle: dict[str, Any] | None = None) -> None:
        if ray_bundle is not None:
            import ray

            from ..envs import setup_device_env

            # Before the engine library is imported: the engine places its own workers (see envs).
            bundle = dict(ray_bundle)
            if bundle.get("executor") == "mp" and not bundle.get("gpu_ids"):
                bundle["gpu_ids"] = tuple(ray.get_gpu_ids())
            setup_device_env(config.backend, ray_bundle=bundle)
        from ..factory import create_engine

        self.engine = create_engine(config)
        # A new id per start, so a proxy can tell a restarted actor from the one it knew.
        self.incarnation = uuid.uuid4().hex[:12]

    async def describe(self) -> dict[str, Any]:
        import ray

        e = self.engine
        return {
            "backend": e.backend_name,
            "capabilities": e.capabilities.model_dump(),
            "weight_receivers": e.weight_receivers(),
            "weight_version": e.weight_version,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "env": {k: os.environ.get(k) for k in REPORTED_ENV},
        }

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        return await self.engine.generate(request)

    async def sleep(self, level: int, tags: Sequence[str] | None) -> None:
        await self.engine.sleep(level, tags)

    async def wake_up(self, tags: Sequence[str] | None) -> None:
        await self.engine.wake_up(tags)

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def pause(self, mode: PauseMode = "wait") -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def init_weight_transfer(self, spec: TransportSpec) -> None:
        await self.engine.init_weight_transfer(spec)

    async def receive_weights(self, manifest: WeightManifest) -> int:
        return await self.engine.receive_weights(manifest)

    async def close_weight_transfer(self) -> None:
        await self.engine.close_weight_transfer()

    async def info(self) -> EngineInfo:
        info = await self.engine.info()
        info.extra = {**info.extra, "incarnation": self.incarnation, "pid": os.getpid()}
        return info

    async def health(self) -> bool:
        return await self.engine.health()

    async def close(self) -> None:
        await self.engine.close()
