"""What the ``remote`` engine needs from a server, whatever its kind."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from rollout_engines.engine import Capabilities
from rollout_engines.errors import CapabilityError
from rollout_engines.types import Completion, EngineConfig, GenerateRequest
from rollout_engines.weights.manifest import TransportSpec, WeightManifest

from ..api_client import ApiClient


class ServerAdapter(abc.ABC):
    """Translates the engine protocol into one server's HTTP API.

    :meth:`connect` runs once, blocking, when the engine is created: it asks the server what it
    serves and sets :attr:`capabilities` (declared by the server where it can say, else by the
    adapter from what that kind of server supports).
    """

    kind: str = "?"
    #: The server side resets its prefix cache after wake-up and weight updates by itself.
    resets_itself: bool = False

    def __init__(self, api: ApiClient, config: EngineConfig) -> None:
        self.api, self.config = api, config
        self.capabilities = Capabilities()
        self.weight_version = 0
        self.weight_receivers = 1
        self.served: dict[str, Any] = {}

    @abc.abstractmethod
    def connect(self) -> None: ...

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest, weight_version: int) -> list[Completion]: ...

    async def sleep(self, level: int, tags: Sequence[str]) -> None:
        raise CapabilityError(f"a {self.kind} server cannot sleep through this adapter")

    async def wake_up(self, tags: Sequence[str]) -> None:
        raise CapabilityError(f"a {self.kind} server cannot wake_up through this adapter")

    async def reset_prefix_cache(self) -> None:
        return None

    async def pause(self) -> None:
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
