"""vLLM's runtime LoRA routes (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), spoken over any engine with
the ``lora`` capability; mounted with the ``openai``, ``vllm-rl``, ``skyrl`` and ``trl`` protocols.

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace": false}``: read the
  PEFT folder ``lora_path`` (``adapter_config.json`` + ``adapter_model.safetensors``) and install it
  under ``lora_name``. ``lora_path`` must lie inside the server's ``--weights-root`` (relative paths
  start there; links are followed), as ``disk`` weight transfers must; without a weights root the
  route is refused (403). The adapter travels as a LoRA push through the server's ``http`` relay
  (:meth:`~rollout_engines_remote.transport.HttpIngress.push`): the checks, atomic install and
  versions of ``/weights/update``. A new name is version 1; ``load_inplace`` of a loaded one
  replaces it as the next version (``/info``'s ``loras``, outputs' ``lora_version``).
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: ``Engine.unload_lora``.

Answers as vLLM's (``vllm/entrypoints/openai/models/serving.py``): 200 with the text ``Success: LoRA
adapter 'NAME' added successfully.`` (``removed`` for unload); a loaded name without
``load_inplace``, an empty name or path, or an adapter the engine refuses: 400 (``InvalidUserInput``,
``BadRequestError``); no folder at the path, unloading a name not loaded: 404 ``NotFoundError``,
in this server's error shape ``{"error": {"type", "message", "param"}}``. Unlike vLLM, names are
the core's adapter names (1-64 letters, digits, ``_``, ``.``, ``-``; others: 422), and a path outside
the weights root is a 403.

Then ``"model": "NAME"`` on ``/v1/completions`` and ``/v1/chat/completions`` selects the adapter, and
``/v1/models`` lists it with ``parent`` = the served model (see :mod:`.openai`).

Loading opens the relay session if none is open; that replaces a session the engine joined over
another transport (``/weights/init`` with ``nccl``, ...): push adapters over that session instead
(``WeightSync.push_lora``), or reconnect the trainer after loading.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import uuid
from collections.abc import Mapping

import torch
from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from rollout_engines.errors import ManifestMismatch
from rollout_engines.types import LORA_NAME_PATTERN, LoraSpec
from rollout_engines.weights.buckets import pack_bucket
from rollout_engines.weights.lora import load_peft_adapter
from rollout_engines.weights.manifest import DEFAULT_TIMEOUT_S, TransportSpec, plan_manifest, specs_of

from ..errors import Conflict, FieldError, error_response
from ..state import ServerState, confine_path

logger = logging.getLogger("rollout_engines.remote.server")


class LoadLoraAdapterBody(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest``."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterBody(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest`` (``lora_int_id`` is accepted and unused: names are the ids here)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_int_id: int | None = None


def router(state: ServerState) -> APIRouter:
    r = APIRouter(tags=["lora"])
    engine = state.engine
    lock = state.lora_lock

    async def install(spec: LoraSpec, tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Push the adapter through the server's ``http`` relay, as ``/weights/update`` receives one."""
        items = list(tensors.items())
        manifest = plan_manifest(specs_of(items), version=version, transport="http", lora=spec)
        if state.ingress.session is None:
            if state.init_started is not None:
                raise Conflict("InitInProgress", "a weight-sync init is in progress; retry once it has answered")
            await state.ingress.open(TransportSpec(transport="http", session_id=f"lora-{uuid.uuid4().hex}",
                                                   timeout_s=DEFAULT_TIMEOUT_S))

        def bucket(index: int) -> torch.Tensor:
            out = torch.empty(manifest.buckets[index].nbytes, dtype=torch.uint8)
            with torch.no_grad():
                return pack_bucket(manifest, index, tensors, out)

        try:
            applied = await state.ingress.push(manifest, bucket)
        except BaseException:
            state.metrics.weight_updates.labels("failed").inc()
            raise
        state.metrics.weight_updates.labels("ok").inc()
        return applied

    @r.post("/v1/load_lora_adapter", response_model=None)
    async def load_lora_adapter(body: LoadLoraAdapterBody) -> Response:
        """Load the PEFT adapter at ``lora_path`` (inside the weights root) as ``lora_name``."""
        name = body.lora_name
        if not name or not body.lora_path:
            return error_response(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
        if not re.match(LORA_NAME_PATTERN, name):
            raise FieldError("lora_name", "adapter names are 1-64 letters, digits, '_', '.' or '-', starting with a "
                             "letter or digit")
        async with lock:
            current = engine.loras.get(name)
            if current is not None and not body.load_inplace:
                return error_response(400, "InvalidUserInput", f"The lora adapter '{name}' has already been loaded. "
                                      "If you want to load the adapter in place, set 'load_inplace' to True.")
            folder = confine_path(body.lora_path, state.weights_root, param="lora_path",
                                  what="LoRA adapters loaded from a path")
            if not os.path.isdir(folder):
                return error_response(404, "NotFoundError", f"Loading lora {name} failed: No adapter found for "
                                      f"{body.lora_path[:300]}", param="lora_path")
            try:
                spec, tensors = await asyncio.to_thread(load_peft_adapter, folder, name)
                version = await install(spec, tensors, (current or 0) + 1)
            except (ValueError, ManifestMismatch) as exc:  # not a usable PEFT folder; refused by the engine
                return error_response(400, "BadRequestError", str(exc))
        logger.info("loaded LoRA adapter '%s' v%d from %s", name, version, folder)
        return Response(status_code=200, content=f"Success: LoRA adapter '{name}' added successfully.")

    @r.post("/v1/unload_lora_adapter", response_model=None)
    async def unload_lora_adapter(body: UnloadLoraAdapterBody) -> Response:
        """Unload the adapter ``lora_name`` (404 if it is not loaded)."""
        name = body.lora_name
        if not name:
            return error_response(400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter.")
        async with lock:
            if not await engine.unload_lora(name):
                return error_response(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.",
                                      param="lora_name")
        logger.info("unloaded LoRA adapter '%s'", name)
        return Response(status_code=200, content=f"Success: LoRA adapter '{name}' removed successfully.")

    return r


__all__ = ["LoadLoraAdapterBody", "UnloadLoraAdapterBody", "router"]

