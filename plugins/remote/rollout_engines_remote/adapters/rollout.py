"""Adapter for a rollout-engines server: the engine protocol maps one to one onto its endpoints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import TypeAdapter
from rollout_engines.engine import Capabilities
from rollout_engines.types import Completion, GenerateRequest
from rollout_engines.weights.manifest import TransportSpec, WeightManifest

from .base import ServerAdapter

_COMPLETIONS = TypeAdapter(list[Completion])
#: Extra seconds a weight call may take beyond the transport's own timeout (queueing, apply).
WEIGHT_MARGIN_S = 60.0


class RolloutServerAdapter(ServerAdapter):
    kind = "rollout"
    resets_itself = True

    def connect(self) -> None:
        info = self.api.get_sync("/info")
        self._apply_info(info)

    def _apply_info(self, info: dict[str, Any]) -> None:
        self.served = info
        caps = dict(info.get("capabilities") or {})
        # Workers run in the server's process(es), never in the caller's: no in-process transport.
        caps["multi_process"] = True
        caps["transports"] = tuple(t for t in caps.get("transports", ()) if t != "inproc")
        known = set(Capabilities.model_fields)
        self.capabilities = Capabilities(**{k: v for k, v in caps.items() if k in known})
        self.weight_version = int(info.get("weight_version", 0))
        self.weight_receivers = int((info.get("extra") or {}).get("server", {}).get("weight_receivers", 1))

    async def generate(self, request: GenerateRequest, weight_version: int) -> list[Completion]:
        resp = await self.api.request("POST", "/generate", content=request.model_dump_json(exclude_defaults=True),
                                      raw=True)
        return _COMPLETIONS.validate_json(resp.content)

    async def sleep(self, level: int, tags: Sequence[str]) -> None:
        await self.api.request("POST", "/sleep", json={"level": level, "tags": list(tags)})

    async def wake_up(self, tags: Sequence[str]) -> None:
        await self.api.request("POST", "/wake_up", json={"tags": list(tags)})

    async def reset_prefix_cache(self) -> None:
        await self.api.request("POST", "/reset_prefix_cache")

    async def pause(self) -> None:
        await self.api.request("POST", "/pause")

    async def resume(self) -> None:
        await self.api.request("POST", "/resume")

    async def init_weight_transfer(self, spec: TransportSpec) -> None:
        await self.api.request("POST", "/weights/init", json=spec.model_dump(mode="json"),
                               timeout=spec.timeout_s + WEIGHT_MARGIN_S)
        if spec.transport == "http":
            from ..transport import Endpoint, register_endpoint  # torch only when weights move

            register_endpoint(spec.session_id, Endpoint(url=self.api.base_url, headers=dict(self.api.headers),
                                                        ranks=self.weight_receivers))
        self._session = spec.session_id

    async def receive_weights(self, manifest: WeightManifest) -> int:
        out = await self.api.request("POST", "/weights/update", content=manifest.model_dump_json(),
                                     timeout=manifest.timeout_s + WEIGHT_MARGIN_S)
        self.weight_version = int(out["weight_version"])
        return self.weight_version

    async def close_weight_transfer(self) -> None:
        session = getattr(self, "_session", None)
        if session is not None:
            from ..transport import unregister_endpoint

            unregister_endpoint(session, self.api.base_url)
            self._session = None
        await self.api.request("POST", "/weights/close")

    async def info(self) -> dict[str, Any]:
        info = await self.api.request("GET", "/info")
        self.weight_version = int(info.get("weight_version", self.weight_version))
        return dict(info)

    async def health(self) -> bool:
        try:
            out = await self.api.request("GET", "/health", timeout=10.0)
        except Exception:
            return False
        return isinstance(out, dict) and out.get("status") == "ok"
