"""Protocol ``trl``: what TRL's ``VLLMClient`` (trl 1.16.0) calls.

TRL 1.16 has no server of its own any more: ``trl vllm-serve`` runs ``vllm serve`` in dev mode and
``VLLMClient`` speaks vLLM's API. So the protocol is the ``openai`` routes (``/v1/completions``
with ``return_token_ids``, ``return_tokens_as_token_ids``, ``prompt_logprobs``;
``/v1/chat/completions``; ``/v1/models``), the ``vllm-rl`` routes (``/get_world_size``,
``/reset_prefix_cache``, the weight-transfer phases) and this router's ``GET /server_info``.
``/health`` is always served.

Weights: TRL pushes them over vLLM's NCCL weight-transfer engine (``StatelessProcessGroup`` +
``PyNcclCommunicator`` + packed broadcasts), whose receiving side lives in vLLM's workers; this
server does not speak it. ``/server_info`` says ``weight_transfer_config: null``, so TRL's
``init_communicator`` stops with its own message ("has no weight-transfer engine") before opening
any group. Push weights with rollout-engines' own weight sync instead (``native`` or ``vllm-rl``).
The older ``trl vllm-serve`` protocol (``/generate/``, ``/init_communicator/``, ...) is not served:
trl 1.16.0's client does not call it.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter

from ..state import ServerState


def router(state: ServerState) -> APIRouter:
    r = APIRouter(tags=["trl"])

    @r.get("/server_info")
    async def server_info(config_format: Literal["text", "json"] = "text") -> dict[str, Any]:
        """The part of vLLM's ``/server_info`` that TRL reads: there is no vLLM weight-transfer engine."""
        config = {"model": state.model_name, "weight_transfer_config": None}
        return {"vllm_config": config if config_format == "json" else str(config), "vllm_env": {}, "system_env": {}}

    return r
