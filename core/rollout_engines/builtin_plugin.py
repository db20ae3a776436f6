"""The core's own plugin: the embedded ``transformers`` backend and the built-in transports,
registered through the same entry point and hooks as any third-party plugin."""

from __future__ import annotations

from collections.abc import Callable

from .hookspecs import hookimpl
from .plugins import BackendEntry, TransportEntry, install_hint

_T = "rollout_engines.weights.transports"


@hookimpl
def register_backends(register: Callable[[BackendEntry], None]) -> None:
    register(
        BackendEntry(
            name="transformers",
            target="rollout_engines.backends.transformers.engine:TransformersEngine",
            install_hint=install_hint(),
            requires=("torch", "transformers"),
            description="Embedded engine on transformers model code (CPU or one GPU).",
            capabilities={"sleep_levels": [1, 2], "transports": ["inproc", "gloo", "nccl", "shm", "disk", "cuda_ipc"]},
            generate_baseline="rollout_engines.bench.baselines:transformers_generate",
        )
    )


@hookimpl
def register_transports(register: Callable[[TransportEntry], None]) -> None:
    for name, module, devices, description in (
        ("inproc", "inproc", ("cpu", "cuda"), "trainer and engine in one process"),
        ("gloo", "broadcast", ("cpu",), "torch.distributed gloo broadcast per bucket"),
        ("nccl", "broadcast", ("cuda",), "torch.distributed NCCL broadcast per bucket"),
        ("shm", "shm", ("cpu",), "shared-memory slots on one host"),
        ("cuda_ipc", "cuda_ipc", ("cuda",), "CUDA IPC handles of bucket buffers on one GPU"),
        ("disk", "disk", ("cpu", "cuda"), "safetensors files in a (shared) directory"),
    ):
        prefix = name.capitalize() if name != "cuda_ipc" else "CudaIpc"
        if module == "broadcast":
            prefix = "Gloo" if name == "gloo" else "Nccl"
        register(
            TransportEntry(
                name=name,
                sender=f"{_T}.{module}:{prefix}Sender",
                receiver=f"{_T}.{module}:{prefix}Receiver",
                devices=devices,
                description=description,
            )
        )
