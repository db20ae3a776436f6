"""One adapter per kind of server the ``remote`` backend can drive (``options["server"]``):

- ``rollout``: a rollout-engines server (``rollout-engines serve``), the full engine protocol;
- ``vllm``: a plain vLLM OpenAI server (dev-mode endpoints for the control plane);
- ``sglang``: a plain SGLang server (its native HTTP API).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_engines.types import EngineConfig

    from ..api_client import ApiClient
    from .base import ServerAdapter

KINDS = ("rollout", "vllm", "sglang")


def make_adapter(kind: str, api: ApiClient, config: EngineConfig) -> ServerAdapter:
    if kind == "rollout":
        from .rollout import RolloutServerAdapter

        return RolloutServerAdapter(api, config)
    if kind == "vllm":
        from .vllm import VllmServerAdapter

        return VllmServerAdapter(api, config)
    if kind == "sglang":
        from .sglang import SglangServerAdapter

        return SglangServerAdapter(api, config)
    raise ValueError(f"options['server'] must be one of {list(KINDS)}, got '{kind}'")
