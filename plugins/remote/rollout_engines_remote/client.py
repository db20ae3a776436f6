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

A :class:`~rollout_engines.proxy.ProxyEngine`: over HTTP to a rollout-engines server (whose engine
keeps the core's rules), or over an in-process channel to a plain server's adapter (which runs
them here). Capabilities are fetched from the server when the engine is created. Closing the
engine closes its connections, never the server.
"""

from __future__ import annotations

import os
from typing import Any

from rollout_engines.engine import Capabilities
from rollout_engines.proxy import Channel, LocalChannel, ProxyEngine
from rollout_engines.types import EngineConfig, EngineInfo

from .adapters import make_adapter
from .adapters.rollout import RolloutServerChannel
from .api_client import ApiClient
from .protocol import API_KEY_ENV


class RemoteEngine(ProxyEngine):
    """An engine served over HTTP. Created by ``create_engine("remote", model=URL, ...)``."""

    capabilities: Capabilities

    def __init__(self, config: EngineConfig) -> None:
        opts = config.options
        url = str(opts.get("url") or config.model)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the remote backend needs a server URL (http://host:port) as model or options['url'], "
                             f"got '{url}'")
        self.url = url.rstrip("/")
        self.server_kind = str(opts.get("server", "rollout"))
        self.api = ApiClient(
            self.url, api_key=opts.get("api_key") or (None if opts.get("api_key_file") else os.environ.get(API_KEY_ENV)),
            api_key_file=opts.get("api_key_file"),
            timeout_s=float(opts.get("timeout_s", 600.0)), connect_timeout_s=float(opts.get("connect_timeout_s", 10.0)),
            retries=int(opts.get("retries", 3)), backoff_s=float(opts.get("backoff_s", 0.2)),
            max_connections=int(opts.get("max_connections", 256)),
        )
        channel: Channel
        if self.server_kind == "rollout":
            channel = RolloutServerChannel(self.api)
            described = channel.connect()
            self.served: dict[str, Any] = described["info"]
        else:
            adapter = make_adapter(self.server_kind, self.api, config)
            adapter.connect()
            local = LocalChannel(adapter.engine(), label=f"the {self.server_kind} server at {self.url}")
            channel, described, self.served = local, local.host.describe(), adapter.served
        super().__init__(channel, config, described, call_timeout_s=float(opts.get("timeout_s", 600.0)),
                         backend_name="remote")
        if opts.get("transports") is not None:
            keep = [t for t in self.capabilities.transports if t in set(opts["transports"])]
            self.capabilities = self.capabilities.model_copy(update={"transports": tuple(keep)})

    async def info(self) -> EngineInfo:
        """The served engine's info, with where it is served from."""
        info = await super().info()
        served_backend = self.described.get("backend")
        return info.model_copy(update={"extra": {**info.extra, "url": self.url, "server_kind": self.server_kind,
                                                 "served_backend": served_backend}})

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            await self.api.aclose()
