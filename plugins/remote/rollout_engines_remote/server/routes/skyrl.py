"""What SkyRL's ``RemoteInferenceClient`` calls beyond vLLM's RL API (protocol ``skyrl``, which
mounts ``vllm-rl`` too; add ``openai`` for its ``chat_completion``/``completion``):
``serve --protocols skyrl,openai``.

- ``POST /tokenize`` ``{"prompt", "add_special_tokens"}`` -> ``{"tokens", "count", "max_model_len"}`` and
  ``POST /detokenize`` ``{"tokens"}`` -> ``{"prompt"}`` (vLLM's shapes), through the model's tokenizer.
- ``POST /finish_session?session_id=``: a router's hint that a sticky session ended; one engine per
  server has nothing to release, so it is acknowledged.
- ``POST /skyrl/v1/generate``: SkyRL's vLLM server's generate (``/inference/v1/generate`` with
  routed experts); served as ``/inference/v1/generate``, ``routed_experts`` ``null``.
- ``POST /collective_rpc`` ``{"method", "kwargs"}``: the weight-update phases SkyRL sends there
  (``skyrl_start_weight_update``, ``update_weights_ipc``/``update_weights_nccl``,
  ``skyrl_finish_weight_update``) mapped onto the ``vllm-rl`` phases; any other method is a 400.

- ``POST /skyrl/v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: SkyRL's load-or-replace, served
  as ``/v1/load_lora_adapter`` with ``load_inplace`` (:mod:`.lora`, which this protocol mounts, with
  ``/v1/unload_lora_adapter``); the path must lie inside ``--weights-root``.

Not supported (400): ``/v1/chat/completions/render`` (multimodal rendering).
SkyRL's client sends no API key: serve it with ``--insecure-no-auth`` on a loopback address.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from rollout_engines.errors import CapabilityError

from ..errors import FieldError
from ..state import ServerState
from . import lora, vllm_rl

#: SkyRL's /collective_rpc methods -> the vllm-rl route that does the same.
RPC_ROUTES = {"skyrl_start_weight_update": "/start_weight_update", "update_weights_ipc": "/update_weights",
              "update_weights_nccl": "/update_weights", "skyrl_finish_weight_update": "/finish_weight_update"}


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt: str = Field(max_length=1_000_000)
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    tokens: list[int] = Field(max_length=1_000_000)
    model: str | None = None


class SkyrlLoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str


class RpcBody(BaseModel):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


def router(state: ServerState) -> APIRouter:
    r = APIRouter(tags=["skyrl"])
    # The vllm-rl handlers this protocol reuses (a router of its own; the paths it serves itself
    # are mounted by the 'vllm-rl' protocol).
    vllm = vllm_rl.router(state)
    handlers = {route.path: route.endpoint for route in vllm.routes if isinstance(route, APIRoute)}
    lora_handlers = {route.path: route.endpoint for route in lora.router(state).routes if isinstance(route, APIRoute)}

    def tokenizer() -> Any:
        tok = state.get_limits().tokenizer
        if tok is None:
            raise CapabilityError("this server has no tokenizer for its model (a transformers tokenizer at the model "
                                  "path); tokenize on the client (RemoteInferenceClient(tokenizer=...))")
        return tok

    @r.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> JSONResponse:
        tok = tokenizer()
        ids = await asyncio.to_thread(lambda: tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        return JSONResponse({"tokens": list(ids), "count": len(ids), "max_model_len": state.engine.config.max_model_len})

    @r.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> JSONResponse:
        tok = tokenizer()
        limits = state.get_limits()
        limits.check_token_ids("tokens", body.tokens, limits.vocab_size or len(tok))
        return JSONResponse({"prompt": await asyncio.to_thread(tok.decode, body.tokens)})

    @r.post("/finish_session")
    async def finish_session(session_id: str) -> JSONResponse:
        return JSONResponse({"status": "ok", "session_id": session_id})

    @r.post("/skyrl/v1/generate")
    async def skyrl_generate(body: vllm_rl.VllmGenerateBody, request: Request) -> Any:
        return await handlers["/inference/v1/generate"](body, request)

    @r.post("/collective_rpc")
    async def collective_rpc(body: RpcBody) -> JSONResponse:
        """SkyRL's weight-update phases; the update itself is the ``vllm-rl`` one (``init_info``
        ``backend``: ``http`` with ``data_b64`` tensors, or a transport with a manifest)."""
        path = RPC_ROUTES.get(body.method)
        if path is None:
            raise CapabilityError(f"collective_rpc method '{body.method}' is not served (no worker extensions run "
                                  f"here); served: {', '.join(RPC_ROUTES)}")
        kw = body.kwargs
        if path == "/start_weight_update":
            answer = await handlers[path](vllm_rl.StartBody(**kw))
        elif path == "/update_weights":
            if "update_info" not in kw:
                raise FieldError("kwargs.update_info", f"'{body.method}' needs kwargs.update_info")
            answer = await handlers[path](vllm_rl.UpdateBody(update_info=kw["update_info"]))
        else:
            answer = await handlers[path](vllm_rl.FinishBody(**kw))
        return answer

    @r.post("/skyrl/v1/load_lora_adapter", response_model=None)
    async def load_lora_adapter(body: SkyrlLoadLoraBody) -> Response:
        """SkyRL's load-or-replace: ``/v1/load_lora_adapter`` with ``load_inplace``."""
        return await lora_handlers["/v1/load_lora_adapter"](
            lora.LoadLoraAdapterBody(lora_name=body.lora_name, lora_path=body.lora_path, load_inplace=True))

    @r.post("/v1/chat/completions/render")
    async def render_chat() -> JSONResponse:
        raise CapabilityError("/v1/chat/completions/render (multimodal rendering) is not supported; send "
                              "text-only prompts as token ids")

    return r
