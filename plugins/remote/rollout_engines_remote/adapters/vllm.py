"""Adapter for a plain vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``).

Generation goes through ``/v1/completions`` (token-id or text prompts, ``return_token_ids`` for
the ids, ``logprobs`` for the sampled tokens' logprobs) and ``/v1/chat/completions``. The control
plane needs the server's development endpoints (``VLLM_SERVER_DEV_MODE=1``): ``/sleep``,
``/wake_up``, ``/reset_prefix_cache``, ``/pause``, ``/resume``, ``/collective_rpc``,
``/server_info``. Weight updates call the vLLM plugin's worker extension through
``/collective_rpc``, so the server must be started with
``--worker-extension-cls rollout_engines_vllm.worker_ext.WorkerExtension`` (and the plugin
importable there); each worker then hosts the core's receiver for ``gloo``/``nccl``/``shm``/``disk``.

Capabilities are what the server turns out to support when the engine connects: no dev mode, no
control plane; no worker extension, no weight transports; CPU, no sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
from rollout_engines.backend_kit import finish_reason
from rollout_engines.engine import Capabilities
from rollout_engines.errors import WeightSyncError
from rollout_engines.proxy import raise_for_workers
from rollout_engines.types import Completion, GenerateRequest, PauseMode, SamplingParams
from rollout_engines.weights.manifest import TransportSpec, WeightManifest

from .base import ServerAdapter

WORKER_EXTENSION = "rollout_engines_vllm.worker_ext.WorkerExtension"
CPU_TRANSPORTS = ("gloo", "shm", "disk")
CUDA_TRANSPORTS = ("nccl", "cuda_ipc", "gloo", "shm", "disk")


def sampling_body(s: SamplingParams) -> dict[str, Any]:
    """vLLM's OpenAI-extra sampling fields for the core's :class:`SamplingParams` (same meanings)."""
    body: dict[str, Any] = {
        "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "min_p": s.min_p,
        "n": s.n, "ignore_eos": s.ignore_eos, "return_token_ids": True,
    }
    if s.top_k != -1:
        body["top_k"] = s.top_k
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        body["seed"] = s.seed
    return body


def worker_results(payload: Any, what: str, *, applies_weights: bool = False) -> list[dict[str, Any]]:
    """The worker extension's per-worker result dicts, or the typed error of the first failure
    (the core's one rule for partial failures: :func:`rollout_engines.proxy.raise_for_workers`)."""
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list):
        raise WeightSyncError(f"{what}: /collective_rpc answered {str(payload)[:200]}")
    parsed: list[dict[str, Any]] = [r if isinstance(r, dict) else {"ok": False, "error": "WeightSyncError", "message": str(r)}
                                    for r in results]
    raise_for_workers(parsed, what, applies_weights=applies_weights, worker="vLLM worker")
    return parsed


class VllmServerAdapter(ServerAdapter):
    """Options: ``served_model`` (default: the first of ``/v1/models``)."""

    kind = "vllm"

    def connect(self) -> None:
        models = self.api.get_sync("/v1/models")
        self.model = str(self.config.options.get("served_model") or models["data"][0]["id"])
        self.dev_mode = self._dev_info()
        device = str(self.dev_mode.get("device", "cpu")) if self.dev_mode is not None else "cpu"
        workers = self._workers() if self.dev_mode is not None else []
        self.weight_receivers = max(1, len(workers))
        transports: tuple[str, ...] = ()
        if workers:
            transports = CUDA_TRANSPORTS if device.startswith("cuda") else CPU_TRANSPORTS
        sleep = self.dev_mode is not None and bool(self.dev_mode.get("sleep_mode")) and device.startswith("cuda")
        self.capabilities = Capabilities(
            chat=True, logprobs=True, n=True, stop_strings=True, seed=True, weights_kept_on_sleep=True,
            sleep_levels=(1, 2) if sleep else (), sleep_tags=("weights", "kv_cache") if sleep else (),
            pause=self.dev_mode is not None, prefix_cache=True, transports=transports,
            tensor_parallel=len(workers) > 1, multi_process=True,
        )
        self.served = {"backend": "vllm", "model": self.model, "device": device, "workers": workers,
                       "dev_mode": self.dev_mode is not None}

    def _dev_info(self) -> dict[str, Any] | None:
        try:
            info = self.api.get_sync("/server_info?config_format=json")
        except Exception:  # no dev mode: generation only
            return None
        config = info.get("vllm_config") if isinstance(info, dict) else None
        config = config if isinstance(config, dict) else {}
        device = (config.get("device_config") or {}).get("device_type") or (config.get("device_config") or {}).get("device")
        sleep_mode = (config.get("model_config") or {}).get("enable_sleep_mode", False)
        return {"device": str(device or "cpu"), "sleep_mode": bool(sleep_mode)}

    def _workers(self) -> list[dict[str, Any]]:
        try:
            with httpx.Client(base_url=self.api.base_url, headers=self.api.headers, timeout=30.0) as c:
                resp = c.post("/collective_rpc", json={"method": "roe_worker_info", "timeout": 20})
            if resp.status_code != 200:
                return []
            results = resp.json().get("results")
            # roe_worker_info answers a plain dict per worker (no "ok" field).
            return [r for r in results if isinstance(r, dict) and "pid" in r] if isinstance(results, list) else []
        except Exception:  # not started with the worker extension: no weight transports
            return []

    # ---- generation ----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest, weight_version: int) -> list[Completion]:
        s = request.sampling
        if request.messages is not None:
            parts = await asyncio.gather(*(self._chat(i, conv, s, weight_version)
                                           for i, conv in enumerate(request.messages)))
            return [c for part in parts for c in part]
        prompt: Any = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompts
        body = {"model": self.model, "prompt": prompt, **sampling_body(s)}
        if s.n > 1 and s.temperature == 0:
            # vLLM refuses n > 1 with greedy sampling; n identical greedy samples are the same
            # prompt n times in a row (prompt-major, so choice i is still prompt i // n).
            body["prompt"] = [p for p in prompt for _ in range(s.n)]
            body["n"] = 1
        if s.logprobs is not None:
            body["logprobs"] = s.logprobs
        out = await self.api.request("POST", "/v1/completions", json=body)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        completions = []
        for choice in choices:
            i = int(choice["index"])
            logprobs = None
            if s.logprobs is not None and choice.get("logprobs"):
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            completions.append(Completion(
                prompt_index=i // s.n, sample_index=i % s.n, prompt_token_ids=choice.get("prompt_token_ids") or [],
                token_ids=choice.get("token_ids") or [], text=choice.get("text") or "", logprobs=logprobs,
                finish_reason=finish_reason(choice.get("finish_reason")), weight_version=weight_version,
            ))
        return completions

    async def _chat(self, index: int, conversation: Sequence[Any], s: SamplingParams, version: int) -> list[Completion]:
        body = {"model": self.model, "messages": [m.model_dump() for m in conversation], **sampling_body(s)}
        if s.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = s.logprobs
        # vLLM refuses n > 1 with greedy sampling: then n identical requests with n = 1.
        calls = s.n if s.n > 1 and s.temperature == 0 else 1
        if calls > 1:
            body["n"] = 1
        outs = await asyncio.gather(*(self.api.request("POST", "/v1/chat/completions", json=body)
                                      for _ in range(calls)))
        if calls > 1:
            choices = [{**o["choices"][0], "index": j} for j, o in enumerate(outs)]
        else:
            choices = sorted(outs[0]["choices"], key=lambda c: c["index"])
        prompt_ids = outs[0].get("prompt_token_ids") or []
        completions = []
        for choice in choices:
            logprobs = None
            if s.logprobs is not None and choice.get("logprobs"):
                logprobs = [float(t["logprob"]) for t in choice["logprobs"]["content"]]
            completions.append(Completion(
                prompt_index=index, sample_index=int(choice["index"]), prompt_token_ids=prompt_ids,
                token_ids=choice.get("token_ids") or [], text=choice["message"].get("content") or "",
                logprobs=logprobs, finish_reason=finish_reason(choice.get("finish_reason")), weight_version=version,
            ))
        return completions

    # ---- control plane -------------------------------------------------------------------------
    async def sleep(self, level: int, tags: Sequence[str]) -> None:
        wanted = set(tags)
        # vLLM sleeps weights and KV cache together; a single tag: wake the other right away
        # (as the in-process vLLM engine does). Level 2 would discard weights that are to stay.
        await self.api.request("POST", f"/sleep?level={level if 'weights' in wanted else 1}")
        keep = sorted({"weights", "kv_cache"} - wanted)
        if keep:
            await self.api.request("POST", "/wake_up?" + "&".join(f"tags={t}" for t in keep))
            if "kv_cache" in keep:
                await self.reset_prefix_cache()

    async def wake_up(self, tags: Sequence[str]) -> None:
        await self.api.request("POST", "/wake_up?" + "&".join(f"tags={t}" for t in tags))

    async def reset_prefix_cache(self) -> None:
        if self.dev_mode is not None:
            await self.api.request("POST", "/reset_prefix_cache")

    async def pause(self, mode: PauseMode) -> None:
        # vLLM's modes mean what the core's do (abort / wait / keep).
        await self.api.request("POST", f"/pause?mode={mode}")

    async def resume(self) -> None:
        await self.api.request("POST", "/resume")

    async def _rpc(self, method: str, *args: str, timeout: float) -> Any:
        body = {"method": method, "args": list(args), "timeout": timeout}
        return await self.api.request("POST", "/collective_rpc", json=body, timeout=timeout + 30)

    async def init_weight_transfer(self, spec: TransportSpec) -> None:
        out = await self._rpc("roe_init_weight_transfer", spec.model_dump_json(), timeout=spec.timeout_s + 30)
        worker_results(out, f"joining the '{spec.transport}' weight sync")

    async def receive_weights(self, manifest: WeightManifest) -> int:
        timeout = manifest.timeout_s * (len(manifest.buckets) + 2)
        out = await self._rpc("roe_receive_weights", manifest.model_dump_json(), timeout=timeout)
        worker_results(out, f"weight update v{manifest.version}", applies_weights=True)
        return manifest.version

    async def close_weight_transfer(self) -> None:
        if self.capabilities.transports:
            await self._rpc("roe_close_weight_transfer", timeout=30)

    async def info(self) -> dict[str, Any]:
        extra = dict(self.served)
        if self.dev_mode is not None and self.capabilities.supports_sleep():
            extra["is_sleeping"] = (await self.api.request("GET", "/is_sleeping")).get("is_sleeping")
        return {"backend": "vllm", "extra": extra}
