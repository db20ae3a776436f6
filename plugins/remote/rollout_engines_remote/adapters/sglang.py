"""Adapter for a plain SGLang server (``python -m sglang.launch_server``), through its native HTTP API.

The SGLang backend plugin (``rollout-engines-sglang``) already knows how to drive SGLang: request
translation, sleep semantics (SGLang releases weights), the ``sglang_nccl`` weight protocol
(``init_weights_update_group`` + one ``update_weights_from_distributed`` per bucket with
``load_format="flattened_bucket"``) and ``disk`` updates. Its engine talks to SGLang through a
small runtime interface; :class:`HttpSglangRuntime` implements that interface on the server's
HTTP endpoints, so the same engine logic drives a server we did not start:

=================================  =====================================================
runtime call                       SGLang HTTP endpoint
=================================  =====================================================
generate                           ``POST /generate`` (``input_ids``, ``sampling_params``)
flush_cache                        ``POST /flush_cache``
pause / resume                     ``POST /pause_generation`` / ``/continue_generation``
release_memory / resume_memory     ``POST /release_memory_occupation`` / ``/resume_memory_occupation``
init_weights_group                 ``POST /init_weights_update_group``
update_from_distributed            ``POST /update_weights_from_distributed``
update_from_tensor                 ``POST /update_weights_from_tensor``
update_from_disk                   ``POST /update_weights_from_disk``
=================================  =====================================================

Weight transports over HTTP: ``sglang_nccl`` (the trainer broadcasts into SGLang's workers) and
``disk`` (a filesystem both sides see). The relayed transports of the in-process engine need the
engine's host process on the server's GPU and are not declared here.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rollout_engines.engine import Engine
from rollout_engines.errors import BackendNotInstalled, CapabilityError, EngineUnavailable
from rollout_engines.types import Completion, EngineConfig, GenerateRequest

from ..api_client import ApiClient
from .base import ServerAdapter

#: Transports a remote SGLang server receives over (see the module docstring).
HTTP_TRANSPORTS = ("sglang_nccl", "disk")


def _check(payload: Any, what: str) -> None:
    from rollout_engines_sglang.runtime import SglangCallFailed

    if isinstance(payload, dict) and payload.get("success") is False:
        raise SglangCallFailed(f"SGLang {what} failed: {payload.get('message', '')}")


class HttpSglangRuntime:
    """``rollout_engines_sglang.runtime.SglangRuntime`` on a running SGLang server's HTTP API."""

    def __init__(self, api: ApiClient, *, tokenizer: str | None = None) -> None:
        self.api = api
        model_info = api.get_sync("/get_model_info")
        server_info = api.get_sync("/get_server_info")
        self.model_path: str = str(model_info.get("model_path", ""))
        self.tp_size = int(server_info.get("tp_size", 1))
        self.context_length = server_info.get("context_length")
        self.weight_loaders: tuple[str, ...] = tuple(server_info.get("custom_weight_loader") or ())
        tok_path = tokenizer or model_info.get("tokenizer_path") or self.model_path
        if not Path(tok_path).is_dir():
            raise ValueError(
                f"the SGLang server's tokenizer '{tok_path}' is not a local directory here; pass "
                "options={'tokenizer': PATH} (prompts are tokenized on the client, as SGLang's own engine does)"
            )
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tok_path)
        self.vocab_size: int | None = None
        config = Path(self.model_path) / "config.json"
        if config.is_file():
            self.vocab_size = json.loads(config.read_text()).get("vocab_size")

    async def _post(self, path: str, body: dict[str, Any], what: str, timeout: float | None = None) -> Any:
        # SGLang answers a control call that failed with HTTP 400 and {"success": false, "message"}
        # (http_server.py: update_weights_from_disk, init_weights_update_group, ...): that is
        # SglangCallFailed, as in-process; any other 400 (a malformed request) stays typed as usual.
        resp = await self.api.request("POST", path, json=body, timeout=timeout, pass_status=(400,))
        if isinstance(resp, httpx.Response):  # a 400
            _check(ApiClient.decoded(resp), what)
            return ApiClient._result(resp, f"POST {self.api.base_url}{path}", False)  # raises, typed
        _check(resp, what)
        return resp

    async def generate(self, **kwargs: Any) -> list[dict[str, Any]]:
        out = await self.api.request("POST", "/generate", json=kwargs)
        outs = out if isinstance(out, list) else [out]
        bad = [o for o in outs if not isinstance(o, dict) or "output_ids" not in o]
        if bad:
            raise EngineUnavailable(f"SGLang /generate answered without output_ids: {str(bad[0])[:300]}")
        return outs

    async def flush_cache(self) -> None:
        await self.api.request("POST", "/flush_cache")

    async def pause(self) -> None:
        # in_place: running requests keep their KV cache and continue after /continue_generation.
        await self.api.request("POST", "/pause_generation", json={"mode": "in_place"})

    async def resume(self) -> None:
        await self.api.request("POST", "/continue_generation", json={})

    async def release_memory(self, tags: Sequence[str]) -> None:
        await self._post("/release_memory_occupation", {"tags": list(tags)}, "release_memory_occupation")

    async def resume_memory(self, tags: Sequence[str]) -> None:
        await self._post("/resume_memory_occupation", {"tags": list(tags)}, "resume_memory_occupation")

    async def init_weights_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                 group_name: str) -> None:
        await self._post("/init_weights_update_group", {
            "master_address": host, "master_port": port, "rank_offset": rank_offset, "world_size": world_size,
            "group_name": group_name, "backend": "nccl"}, "init_weights_update_group")

    async def destroy_weights_group(self, group_name: str) -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name}, "destroy_weights_update_group")

    async def update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                      group_name: str) -> None:
        await self._post("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": False, "load_format": "flattened_bucket"}, "update_weights_from_distributed")

    async def update_from_tensor(self, payloads: list[bytes], load_format: str = "flattened_bucket") -> None:
        if len(payloads) != self.tp_size:
            raise ValueError(f"{len(payloads)} payloads for {self.tp_size} TP ranks; give one per rank")
        # The HTTP API takes each rank's serialized payload base64-encoded.
        await self._post("/update_weights_from_tensor", {
            "serialized_named_tensors": [base64.b64encode(p).decode() for p in payloads],
            "load_format": load_format, "flush_cache": False}, "update_weights_from_tensor")

    async def update_from_disk(self, path: str) -> None:
        await self._post("/update_weights_from_disk", {"model_path": path, "flush_cache": False},
                         "update_weights_from_disk")

    def serialize(self, obj: Any) -> bytes:
        raise CapabilityError("CUDA IPC payloads need SGLang in this process and the server's GPU; "
                              "push to a remote SGLang server over 'sglang_nccl' or 'disk'")

    def shutdown(self) -> None:
        return None  # the server is not ours to stop


class SglangServerAdapter(ServerAdapter):
    """Drives a plain SGLang server with the SGLang plugin's engine logic over HTTP.

    The SGLang plugin's engine (over :class:`HttpSglangRuntime`) is itself a core
    :class:`~rollout_engines.engine.Engine`, so it is what :meth:`engine` serves: its rules, once.

    Options: ``tokenizer`` (local tokenizer directory, default the server's ``tokenizer_path``),
    ``model_path`` (local checkpoint for manifest validation, default the server's ``model_path``),
    ``enable_deterministic_inference`` / ``enable_weights_cpu_backup`` (say how the server was
    started: they decide whether seeds work and whether weights survive sleep).
    """

    kind = "sglang"

    def connect(self) -> None:
        try:
            from rollout_engines_sglang.engine import SglangEngine
        except ImportError as exc:
            raise BackendNotInstalled(
                "remote", 'pip install "rollout-engines-sglang" (SGLang itself is not needed on the client)',
                cause=str(exc),
            ) from exc
        opts = self.config.options
        runtime = HttpSglangRuntime(self.api, tokenizer=opts.get("tokenizer"))
        inner_opts: dict[str, Any] = {k: opts[k] for k in ("enable_deterministic_inference", "enable_weights_cpu_backup")
                      if k in opts}
        model = str(opts.get("model_path") or runtime.model_path)
        inner_config = EngineConfig(backend="sglang", model=model, tokenizer=opts.get("tokenizer"),
                                    max_model_len=self.config.max_model_len, options=inner_opts)
        self.inner = SglangEngine(inner_config, runtime=runtime)
        caps = self.inner.capabilities
        transports = tuple(t for t in caps.transports if t in HTTP_TRANSPORTS)
        self.capabilities = caps.model_copy(update={"transports": transports, "multi_process": True})
        self.inner.capabilities = self.capabilities  # what this engine can do through HTTP
        self.weight_receivers = self.inner.weight_receivers()
        self.served = {"backend": "sglang", "model_path": runtime.model_path, "tp_size": runtime.tp_size}

    def engine(self) -> Engine:
        return self.inner

    async def generate(self, request: GenerateRequest, weight_version: int) -> list[Completion]:
        return await self.inner.generate(request)
