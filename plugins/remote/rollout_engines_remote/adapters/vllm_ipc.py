"""Pushes into a plain vLLM server through vLLM's own IPC weight-transfer engine (no worker extension).

A vLLM server started with ``--weight-transfer-config '{"backend": "ipc"}'`` and the development
endpoints (``VLLM_SERVER_DEV_MODE=1``) loads weights from CUDA IPC handles posted to its RL routes
(vLLM's ``vllm/entrypoints/serve/dev/rlhf/api_router.py`` and
``vllm/distributed/weight_transfer/ipc_engine.py``, read at 0.26 and 0.32):

1. ``POST /init_weight_transfer_engine`` ``{"init_info": {}}``, once;
2. per update ``POST /start_weight_update`` (vLLM starts a layer-wise reload), then one
   ``POST /update_weights`` per bucket with ``{"update_info": {"names", "dtype_names", "shapes",
   "ipc_handles_pickled", "packed": false}}`` (each tensor's ``rebuild_cuda_tensor`` arguments keyed
   by the GPU's UUID, pickled and base64-encoded: the only form vLLM takes over HTTP), then
   ``POST /finish_weight_update`` (vLLM post-processes the layers).

So the ``remote`` engine keeps the core's sessions: the trainer's ``cuda_ipc`` sender hands buckets
to a receiver hosted here, in the trainer's process (the adapter runs beside the trainer), whose
target posts each bucket's tensors to vLLM and returns once vLLM loaded them. Nothing is unpickled
here; the server unpickles, and vLLM refuses to unless it was started with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: serve it on loopback only, beside the trainer.

Checks: the manifest is validated before ``/start_weight_update`` against the served checkpoint's
safetensors headers when the server's model is a local directory (colocated: the usual case), so
a bad push changes nothing. vLLM loads each bucket as it comes and has no rollback: an update that
fails after a bucket was posted leaves the weights mixed, and generation is refused
(:class:`WeightsInvalidated`) until a complete push. Partial and delta pushes are refused (vLLM's
layer-wise reload expects whole layers).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import pickle
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rollout_engines.weights.manifest import TensorSpec, WeightManifest

logger = logging.getLogger("rollout_engines.remote.vllm_ipc")

#: The vLLM weight-transfer backend this module speaks.
BACKEND = "ipc"


def update_info(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """vLLM's IPC ``update_info`` for CUDA tensors ``named`` (non-packed: one handle per tensor,
    views of one buffer share its handle)."""
    from rollout_engines.weights.transports.cuda_ipc import device_uuid
    from torch.multiprocessing.reductions import reduce_tensor

    handles = []
    for name, tensor in named:
        if tensor.device.type != "cuda":
            raise ValueError(f"'{name}' is on {tensor.device}; vLLM's IPC engine takes CUDA tensors")
        _rebuild, args = reduce_tensor(tensor.detach())
        handles.append({device_uuid(tensor.device): args})
    return {
        "names": [n for n, _ in named],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode(),
        "packed": False,
    }


def served_checkpoint_specs(model: str | None, dtype: str | None) -> dict[str, TensorSpec] | None:
    """The served checkpoint's tensors (names, shapes, runtime dtype) where ``model`` is a local
    directory with safetensors files, else None."""
    from rollout_engines.weights.checkpoint import checkpoint_specs

    if not model or not Path(model).is_dir() or not any(Path(model).glob("*.safetensors")):
        return None
    runtime = dtype.removeprefix("torch.") if dtype and dtype != "auto" else None
    return checkpoint_specs(model, runtime)


class NativeIpcTarget:
    """The receiver's target: posts each bucket to vLLM's ``/update_weights`` and waits for it.

    ``post(update_info)`` is a coroutine run on ``loop`` (the engine's), since the receiver runs
    in a worker thread. ``specs``: what an update may carry (None: taken from the manifest, so
    vLLM's loader is the only check)."""

    def __init__(self, post: Callable[[dict[str, Any]], Coroutine[Any, Any, Any]],
                 specs: Mapping[str, TensorSpec] | None) -> None:
        self.post, self.specs = post, specs
        self.loop: asyncio.AbstractEventLoop | None = None
        self.manifest: WeightManifest | None = None
        self.posted = 0  #: buckets vLLM loaded in the current update

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        if self.specs is not None:
            return self.specs
        assert self.manifest is not None
        return {t.name: TensorSpec(name=t.name, dtype=t.dtype, shape=t.shape) for t in self.manifest.tensors}

    def apply(self, named: Sequence[tuple[str, torch.Tensor]], *, owned: bool) -> None:
        if not named:
            return
        # The bucket was written on the trainer's streams; vLLM's workers read it from another process.
        torch.cuda.synchronize(named[0][1].device)
        info = update_info(named)
        assert self.loop is not None
        asyncio.run_coroutine_threadsafe(self.post(info), self.loop).result()
        self.posted += 1
