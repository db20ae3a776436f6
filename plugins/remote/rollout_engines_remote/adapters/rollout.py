"""The channel to a rollout-engines server: each method of the engine protocol is one route.

The server's engine runs the core, so the ``remote`` engine is a plain
:class:`~rollout_engines.proxy.ProxyEngine` over this channel (no rule is applied twice).

==========================  =============================================================
protocol method             route
==========================  =============================================================
generate, chat              ``POST /generate`` (GenerateRequest -> list[Completion])
stream                      ``POST /generate/stream`` (server-sent events of StreamDelta)
abort / abort_all           ``POST /abort`` ``{"request_ids": [...]}`` / ``{"all": true}``
sleep / wake_up             ``POST /sleep`` ``{"level", "tags"}`` / ``POST /wake_up`` ``{"tags"}``
reset_prefix_cache          ``POST /reset_prefix_cache``
pause / resume              ``POST /pause`` ``{"mode"}`` / ``POST /resume``
init_weight_transfer        ``POST /weights/init`` (TransportSpec)
receive_weights             ``POST /weights/update`` (WeightManifest -> ``{"weight_version"}``)
close_weight_transfer       ``POST /weights/close``
unload_lora                 ``POST /lora/unload`` ``{"name"}`` (-> ``{"unloaded"}``); LoRA pushes are
                            ``receive_weights`` with ``manifest.lora`` set
info / health               ``GET /info`` / ``GET /health``
diagnostics                 ``GET /diagnostics[?fingerprint=true]`` (-> Diagnostics)
close                       nothing: the server outlives its clients (closing one closes its connections)
==========================  =============================================================
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from rollout_engines.errors import EngineUnavailable, WeightSyncError
from rollout_engines.proxy import Channel
from rollout_engines.weights.manifest import manifest_from_wire

from ..api_client import ApiClient
from ..protocol import error_from_payload

#: method -> (HTTP method, path); bodies are made by :meth:`RolloutServerChannel._body`.
ROUTES: dict[str, tuple[str, str]] = {
    "generate": ("POST", "/generate"), "chat": ("POST", "/generate"),
    "abort": ("POST", "/abort"), "abort_all": ("POST", "/abort"),
    "sleep": ("POST", "/sleep"), "wake_up": ("POST", "/wake_up"),
    "reset_prefix_cache": ("POST", "/reset_prefix_cache"),
    "pause": ("POST", "/pause"), "resume": ("POST", "/resume"),
    "init_weight_transfer": ("POST", "/weights/init"),
    "receive_weights": ("POST", "/weights/update"),
    "close_weight_transfer": ("POST", "/weights/close"),
    "unload_lora": ("POST", "/lora/unload"),
    "info": ("GET", "/info"), "health": ("GET", "/health"), "diagnostics": ("GET", "/diagnostics"),
}
STREAM_PATH = "/generate/stream"


class RolloutServerChannel(Channel):
    """Calls a rollout-engines server's native routes (see the module docstring)."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api
        self.label = api.base_url
        self.weight_receivers = 1
        self._session: str | None = None

    def connect(self) -> dict[str, Any]:
        """The served engine's description (blocking: runs while the engine is created)."""
        info = self.api.get_sync("/info")
        extra = dict(info.get("extra") or {})
        self.weight_receivers = int((extra.get("server") or {}).get("weight_receivers", 1))
        return {"backend": info.get("backend", "?"), "capabilities": dict(info.get("capabilities") or {}),
                "weight_version": int(info.get("weight_version", 0)), "weight_receivers": self.weight_receivers,
                "loras": dict(info.get("loras") or {}), "info": info}

    @staticmethod
    def _body(method: str, args: dict[str, Any]) -> Any:
        if method in ("generate", "chat"):
            return args["request"]
        if method == "abort":
            return {"request_ids": list(args["request_ids"])}
        if method == "abort_all":
            return {"all": True}
        if method == "init_weight_transfer":
            return args["spec"]
        if method == "receive_weights":
            return json.loads(manifest_from_wire(args["manifest"]).model_dump_json())
        if method in ("sleep", "wake_up", "pause"):
            return args
        if method == "unload_lora":
            return {"name": args["name"]}
        return None

    async def call(self, method: str, args: dict[str, Any], timeout_s: float | None) -> Any:
        if method == "close":
            return None
        if method == "health":
            try:
                out = await self.api.request("GET", "/health", timeout=min(timeout_s or 10.0, 10.0))
            except Exception:
                return False
            return isinstance(out, dict) and out.get("status") == "ok"
        if method == "close_weight_transfer" and self._session is not None:
            from ..transport import unregister_endpoint

            unregister_endpoint(self._session, self.api.base_url)
            self._session = None
        verb, path = ROUTES[method]
        if method == "diagnostics" and args.get("fingerprint"):
            path += "?fingerprint=true"
        body = self._body(method, args)
        try:
            out = await self.api.request(verb, path, json=body, timeout=timeout_s)
        except Exception as exc:
            if method == "init_weight_transfer" and args["spec"].get("transport") == "http":
                from ..transport import refuse_session

                # The trainer's sender waits for this server's endpoint: it fails now, saying why.
                refuse_session(str(args["spec"]["session_id"]), WeightSyncError(
                    f"http: the server at {self.api.base_url} did not join the weight sync: {exc}",
                    peer=self.api.base_url))
            raise
        if method == "init_weight_transfer" and args["spec"].get("transport") == "http":
            from ..transport import Endpoint, register_endpoint  # torch only when weights move

            session = str(args["spec"]["session_id"])
            register_endpoint(session, Endpoint(url=self.api.base_url, headers=dict(self.api.headers),
                                                ranks=self.weight_receivers))
            self._session = session
        if method == "receive_weights":
            return int(out["weight_version"])
        if method == "unload_lora":
            return bool(out["unloaded"])
        if method in ("generate", "chat", "info", "diagnostics"):
            return out
        return None

    async def stream(self, request: Any, timeout_s: float | None) -> AsyncIterator[Any]:
        where = f"POST {self.api.base_url}{STREAM_PATH}"
        timeout = httpx.Timeout(timeout_s, connect=self.api.timeout.connect) if timeout_s else self.api.timeout
        try:
            async with self.api.client().stream("POST", STREAM_PATH, json=request, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    try:
                        payload: Any = resp.json()
                    except ValueError:
                        payload = resp.text
                    raise error_from_payload(resp.status_code, payload, where)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        item = json.loads(data)
                    except ValueError:
                        raise EngineUnavailable(f"{where}: the stream broke: not a JSON event ({data[:200]!r}); "
                                                "is something between client and server cutting it?") from None
                    if isinstance(item, dict) and isinstance(item.get("error"), dict):
                        # The error event carries the status the error would have had as an answer
                        # ("code"): the same exception as a plain call gets for it.
                        code = item["error"].get("code")
                        status = code if isinstance(code, int) and not isinstance(code, bool) else 500
                        raise error_from_payload(status, item, where)
                    yield item
        except httpx.TimeoutException as exc:
            raise EngineUnavailable(f"{where}: no delta in time ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{where}: the stream broke ({exc!r}); is the server running?") from exc
        raise EngineUnavailable(f"{where}: the stream ended without [DONE]")
