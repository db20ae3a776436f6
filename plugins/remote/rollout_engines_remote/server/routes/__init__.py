"""The server's routes, one module per surface; each exposes ``router(state) -> APIRouter``.

Protocols (``create_app(protocols=...)``, ``serve --protocols``) pick the generation-facing APIs:
``native`` (``/generate``, ``/generate/stream``, ``/abort``, with the control plane and weight
sync the remote client drives) and ``openai`` (``/v1/*``, with vLLM's runtime LoRA routes,
:mod:`.lora`, which ``vllm-rl``, ``skyrl`` and ``trl`` mount too). Status routes (``/info``, ``/health``,
``/metrics``) are always served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastapi import APIRouter

from ..state import ServerState
from . import control, lora, native, openai, skyrl, status, trl, vllm_rl, weights

#: Protocol name -> the routers it mounts.
PROTOCOLS: dict[str, tuple[Callable[[ServerState], APIRouter], ...]] = {
    "native": (native.router, control.router, weights.router),
    "openai": (openai.router, lora.router),
    "vllm-rl": (vllm_rl.router, lora.router),
    "skyrl": (vllm_rl.router, lora.router, skyrl.router),
    "trl": (openai.router, lora.router, vllm_rl.router, trl.router),
}
DEFAULT_PROTOCOLS = ("openai", "native")
ALWAYS: tuple[Callable[[ServerState], APIRouter], ...] = (status.router,)


def check_protocols(protocols: Sequence[str]) -> tuple[str, ...]:
    """``protocols`` without repeats, each a known one (``ValueError`` otherwise)."""
    chosen = tuple(dict.fromkeys(p.strip() for p in protocols if p.strip()))
    unknown = [p for p in chosen if p not in PROTOCOLS]
    if unknown or not chosen:
        raise ValueError(f"unknown protocol(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(PROTOCOLS)}")
    return chosen


def routers(state: ServerState, protocols: Sequence[str]) -> list[APIRouter]:
    # A router two chosen protocols share (``trl`` and ``openai``: the OpenAI routes) is mounted once.
    makers = dict.fromkeys(make for p in check_protocols(protocols) for make in PROTOCOLS[p])
    out = [make(state) for make in makers]
    return out + [make(state) for make in ALWAYS]
