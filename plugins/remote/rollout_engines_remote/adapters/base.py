"""What the ``remote`` engine needs from a plain server (one that does not run rollout-engines).

A plain server applies none of the core's rules, so they run here: each adapter is served to the
``remote`` engine as an :class:`~rollout_engines.engine.Engine` (:meth:`ServerAdapter.engine`)
behind an in-process channel (:class:`~rollout_engines.proxy.LocalChannel`), which gives it the
same protocol surface, wire values and error format as every other proxy. What the plain server
cannot do raises :class:`CapabilityError`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from rollout_engines.engine import Capabilities, Engine
from rollout_engines.errors import CapabilityError
from rollout_engines.types import Completion, EngineConfig, EngineInfo, GenerateRequest, PauseMode
from rollout_engines.weights.manifest import TransportSpec, WeightManifest

from ..api_client import ApiClient


class ServerAdapter(abc.ABC):
    """Translates the engine's hooks into one plain server's HTTP API.

    :meth:`connect` runs once, blocking, when the engine is created: it asks the server what it
    serves and sets :attr:`capabilities` (from what that kind of server supports).
    """

    kind: str = "?"

    def __init__(self, api: ApiClient, config: EngineConfig) -> None:
        self.api, self.config = api, config
        self.capabilities = Capabilities()
        self.weight_version = 0
        self.weight_receivers = 1
        self.served: dict[str, Any] = {}

    @abc.abstractmethod
    def connect(self) -> None: ...

    def engine(self) -> Engine:
        """The engine the ``remote`` backend serves: the core's rules over this adapter."""
        return AdapterEngine(self)

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest, weight_version: int) -> list[Completion]: ...

    async def sleep(self, level: int, tags: Sequence[str]) -> None:
        raise CapabilityError(f"a {self.kind} server cannot sleep through this adapter")

    async def wake_up(self, tags: Sequence[str]) -> None:
        raise CapabilityError(f"a {self.kind} server cannot wake_up through this adapter")

    async def reset_prefix_cache(self) -> None:
        return None

    async def pause(self, mode: PauseMode) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def init_weight_transfer(self, spec: TransportSpec) -> None:
        raise CapabilityError(f"a {self.kind} server cannot receive weights through this adapter")

    async def receive_weights(self, manifest: WeightManifest) -> int:
        raise CapabilityError(f"a {self.kind} server cannot receive weights through this adapter")

    async def close_weight_transfer(self) -> None:
        return None

    async def info(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        return None

    async def health(self) -> bool:
        try:
            await self.api.request("GET", "/health", timeout=10.0)
            return True
        except Exception:
            return False


class AdapterEngine(Engine):
    """The core's rules over a :class:`ServerAdapter` (hooks forwarded to it one to one)."""

    def __init__(self, adapter: ServerAdapter) -> None:
        super().__init__(adapter.config)
        self.adapter = adapter
        self.backend_name = adapter.kind  # type: ignore[misc]  # the plain server's kind
        self.capabilities = adapter.capabilities
        self.weight_version = adapter.weight_version

    def weight_receivers(self) -> int:
        return self.adapter.weight_receivers

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        return await self.adapter.generate(request, self.weight_version)

    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        await self.adapter.sleep(level, tags)

    async def _wake_up(self, tags: Sequence[str]) -> None:
        await self.adapter.wake_up(tags)

    async def _reset_prefix_cache(self) -> None:
        await self.adapter.reset_prefix_cache()

    async def _pause(self, mode: PauseMode) -> None:
        await self.adapter.pause(mode)

    async def _resume(self) -> None:
        await self.adapter.resume()

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        await self.adapter.init_weight_transfer(spec)

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        await self.adapter.receive_weights(manifest)

    async def _close_weight_transfer(self) -> None:
        await self.adapter.close_weight_transfer()

    async def _close(self) -> None:
        await self.adapter.close()

    def _extra_info(self) -> dict[str, Any]:
        return dict(self.adapter.served)

    async def info(self) -> EngineInfo:
        info = await super().info()
        served = await self.adapter.info()
        return info.model_copy(update={"extra": {**info.extra, **dict(served.get("extra") or {})}})

    async def health(self) -> bool:
        return await super().health() and await self.adapter.health()
