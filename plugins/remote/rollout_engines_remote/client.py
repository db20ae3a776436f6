"""The ``remote`` backend: a server over HTTP that looks like a local engine.

    engine = roe.create_engine("remote", model="http://127.0.0.1:8000", api_key_file="~/.cache/rollout-engines/serve-8000.key")
    engine = roe.create_engine("remote", model="http://host:8000", server="vllm")    # plain vLLM
    engine = roe.create_engine("remote", model="http://host:30000", server="sglang") # plain SGLang

Options: ``url`` (else ``EngineConfig.model`` is the URL), ``server`` (``rollout`` | ``vllm`` |
``sglang``, default ``rollout``), ``api_key`` or ``api_key_file`` (a file holding the key, e.g. the
one ``rollout-engines serve`` writes; else ``$ROLLOUT_ENGINES_API_KEY``), ``timeout_s``
(per request, default 600), ``connect_timeout_s`` (10), ``retries`` (3, idempotent calls only),
``backoff_s`` (0.2), ``max_connections`` (256), ``transports`` (declare only these of the server's
weight transports, e.g. ``["http"]``).

Capabilities are fetched from the server when the engine is created (a rollout-engines server
declares its engine's; plain vLLM / SGLang servers get what their adapter can drive).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rollout_engines.engine import Engine
from rollout_engines.types import Completion, EngineConfig, EngineInfo, GenerateRequest, PauseMode
from rollout_engines.weights.manifest import TransportSpec, WeightManifest

from .adapters import make_adapter
from .api_client import ApiClient
from .protocol import API_KEY_ENV


class RemoteEngine(Engine):
    """An engine served over HTTP. Created by ``create_engine("remote", model=URL, ...)``."""

    backend_name = "remote"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        opts = config.options
        url = str(opts.get("url") or config.model)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the remote backend needs a server URL (http://host:port) as model or options['url'], "
                             f"got '{url}'")
        self.url = url.rstrip("/")
        self._reset_done = False
        self.server_kind = str(opts.get("server", "rollout"))
        self.api = ApiClient(
            self.url, api_key=opts.get("api_key") or (None if opts.get("api_key_file") else os.environ.get(API_KEY_ENV)),
            api_key_file=opts.get("api_key_file"),
            timeout_s=float(opts.get("timeout_s", 600.0)), connect_timeout_s=float(opts.get("connect_timeout_s", 10.0)),
            retries=int(opts.get("retries", 3)), backoff_s=float(opts.get("backoff_s", 0.2)),
            max_connections=int(opts.get("max_connections", 256)),
        )
        self.adapter = make_adapter(self.server_kind, self.api, config)
        self.adapter.connect()
        self.capabilities = self.adapter.capabilities
        if opts.get("transports") is not None:
            keep = [t for t in self.capabilities.transports if t in set(opts["transports"])]
            self.capabilities = self.capabilities.model_copy(update={"transports": tuple(keep)})
        self.weight_version = self.adapter.weight_version

    # ---- hooks ---------------------------------------------------------------------------------
    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        return await self.adapter.generate(request, self.weight_version)

    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        await self.adapter.sleep(level, tags)

    async def _wake_up(self, tags: Sequence[str]) -> None:
        await self.adapter.wake_up(tags)
        self._reset_done = self.adapter.resets_itself

    async def _reset_prefix_cache(self) -> None:
        # The core resets the prefix cache after wake-up and after every update; where the server
        # side already did (an engine behind it runs the same core rule), one round trip is saved.
        if self._reset_done:
            self._reset_done = False
            return
        await self.adapter.reset_prefix_cache()

    async def _pause(self, mode: PauseMode) -> None:
        await self.adapter.pause()

    async def _resume(self) -> None:
        await self.adapter.resume()

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        await self.adapter.init_weight_transfer(spec)

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        await self.adapter.receive_weights(manifest)
        self._reset_done = self.adapter.resets_itself

    async def _close_weight_transfer(self) -> None:
        await self.adapter.close_weight_transfer()

    async def _close(self) -> None:
        try:
            await self.adapter.close()
        finally:
            await self.api.aclose()

    def weight_receivers(self) -> int:
        return self.adapter.weight_receivers

    # ---- status --------------------------------------------------------------------------------
    async def info(self) -> EngineInfo:
        """This engine's view, with the server's state (version, asleep, queue) where it reports it."""
        local = await super().info()
        if self.closed:
            return local
        served = await self.adapter.info()
        if not served:
            return local.model_copy(update={"extra": {"url": self.url, "server_kind": self.server_kind}})
        self.weight_version = int(served.get("weight_version", self.weight_version))
        return local.model_copy(update={
            "weight_version": self.weight_version,
            "asleep": sorted(set(served.get("asleep", [])) | set(local.asleep)),
            "paused": bool(served.get("paused", local.paused)),
            "outstanding": int(served.get("outstanding", local.outstanding)),
            "healthy": local.healthy and bool(served.get("healthy", True)),
            # The served engine's own extra (device, queue, ...) plus where it is served from.
            "extra": {**dict(served.get("extra") or {}), "url": self.url, "server_kind": self.server_kind,
                      "served_backend": served.get("backend")},
        })

    async def health(self) -> bool:
        return not self.closed and await self.adapter.health()

    @staticmethod
    def generate_benchmark(args: Any) -> dict[str, Any]:
        """``rollout-engines bench generate --backend remote``: starts a server of
        ``args.served_backend`` (default ``transformers``) on ``args.model`` and runs the same batch
        through it and in-process; ``ratio`` = remote tokens/s / in-process tokens/s."""
        from .bench import generate_benchmark

        return generate_benchmark(args)

    def _extra_info(self) -> dict[str, Any]:
        return {"url": self.url, "server_kind": self.server_kind}
