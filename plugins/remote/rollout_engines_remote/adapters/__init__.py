"""How the ``remote`` backend reaches each kind of server (``options["server"]``):

- ``rollout``: a rollout-engines server (``rollout-engines serve``): a channel, one route per
  method of the engine protocol (:mod:`.rollout`); the server's engine keeps the rules;
- ``vllm``: a plain vLLM OpenAI server (dev-mode endpoints for the control plane);
- ``sglang``: a plain SGLang server (its native HTTP API).

Plain servers run none of the core's rules; their adapters are served as engines in this process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_engines.types import EngineConfig

    from ..api_client import ApiClient
    from .base import ServerAdapter

KINDS = ("rollout", "vllm", "sglang")


def make_adapter(kind: str, api: ApiClient, config: EngineConfig) -> ServerAdapter:
    """The adapter of a plain server (``vllm`` or ``sglang``)."""
    if kind == "vllm":
        from .vllm import VllmServerAdapter

        return VllmServerAdapter(api, config)
    if kind == "sglang":
        from .sglang import SglangServerAdapter

        return SglangServerAdapter(api, config)
    raise ValueError(f"options['server'] must be one of {list(KINDS)}, got '{kind}'")
