"""Entry point of ``rollout-engines-sglang``: registers the ``sglang`` backend.

Registration is metadata only (no SGLang, no torch): the engine class is imported when an engine
is created, and the capabilities listed here are the defaults of :class:`SglangEngine`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout_engines import BackendEntry, TransportEntry, hookimpl
from rollout_engines.plugins import first_party_hint

#: Right for where the core was installed from (an index, or a checkout's plugins/sglang).
INSTALL_HINT = first_party_hint("sglang")

#: The transports an SGLang engine receives weights over (see ``engine.py`` for how each maps
#: onto SGLang's API). Kept here, import-free, so listings need no SGLang.
#: ``sglang_nccl``: SGLang's scheduler receives the broadcast itself (update_weights_from_distributed);
#: ``disk``: update_weights_from_disk; the others are received by the engine's host process and
#: handed to SGLang as flattened CUDA IPC buckets (update_weights_from_tensor).
TRANSPORTS = ("sglang_nccl", "cuda_ipc", "disk", "nccl", "gloo", "shm", "inproc")

DEFAULT_CAPABILITIES: dict[str, Any] = {
    "chat": True,
    "logprobs": True,
    "n": True,
    "stop_strings": True,
    # sampling_seed is honoured only with enable_deterministic_inference=True (then declared).
    "seed": False,
    "sleep_levels": [1],
    "sleep_tags": ["weights", "kv_cache"],
    # SGLang releases weights on sleep (unless enable_weights_cpu_backup=True): a push must follow.
    "weights_kept_on_sleep": False,
    "pause": True,
    "prefix_cache": True,
    "transports": list(TRANSPORTS),
    "tensor_parallel": True,
    "multi_process": True,
    # Async RL (see engine.py): SGLang's stream (async_generate(stream=True)), abort_request(rid),
    # pause_generation(mode="abort" / "retract") for the core's "abort" / "keep" ("wait" drains,
    # then pauses in place), top_logprobs_num, logprob_start_len=0, prompt + earlier tokens.
    "streaming": True,
    "abort": True,
    "pause_modes": ["wait", "abort", "keep"],
    # SGLang has no cap of its own on top_logprobs_num; 20 as vLLM's default max_logprobs.
    "top_logprobs": 20,
    "prompt_logprobs": True,
    "continuation": True,
}

#: The capabilities above that need SGLang's in-process runtime (streaming, abort by rid, pause
#: modes); an engine over a runtime without them (e.g. the remote plugin's HTTP one) drops them.
ASYNC_RL_CAPABILITIES = ("streaming", "abort", "pause_modes", "top_logprobs", "prompt_logprobs", "continuation")


@hookimpl
def register_backends(register: Callable[[BackendEntry], None]) -> None:
    register(
        BackendEntry(
            name="sglang",
            target="rollout_engines_sglang.engine:SglangEngine",
            install_hint=INSTALL_HINT,
            requires=("sglang",),
            description="SGLang's in-process Engine (CUDA): colocated, tensor parallel, sleep/wake.",
            capabilities=DEFAULT_CAPABILITIES,
            main_thread_setup="rollout_engines_sglang.signals:install_child_failure_guard",
        )
    )


@hookimpl
def register_transports(register: Callable[[TransportEntry], None]) -> None:
    register(
        TransportEntry(
            name="sglang_nccl",
            sender="rollout_engines_sglang.transport:SglangNcclSender",
            receiver="rollout_engines_sglang.transport:SglangNcclReceiver",
            devices=("cuda",),
            description="NCCL broadcast received by SGLang's own scheduler (flattened buckets)",
        )
    )
