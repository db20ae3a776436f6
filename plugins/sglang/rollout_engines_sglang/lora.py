"""LoRA adapters on the SGLang backend: received like weights, loaded with SGLang's from-tensors API.

A push (:meth:`~rollout_engines.weights.session.WeightSync.push_lora`) arrives through the engine's
weight transfer, as a full push does: the core's receiver in the host process takes it
(:func:`rollout_engines.weights.lora.receive_lora`, checked against the base model's layers that
SGLang was started to adapt, before any bucket is read; a refused push is drained, so the session
stays in step). The adapter is then staged in one flat buffer on the relay device and handed to
every TP rank over CUDA IPC, as a flattened bucket, with SGLang's
``TokenizerManager.load_lora_adapter_from_tensors`` (``LoadLoRAAdapterFromTensorsReqInput``,
python/sglang/srt/managers/io_struct.py; each rank copies its slice to the CPU, so nothing has to
outlive the call). No folder is written: SGLang keeps the adapter's tensors itself.

**Versions.** SGLang refuses a second adapter under a registered name (``LoRARegistry``,
python/sglang/srt/lora/lora_registry.py), so every version is registered under a name of its own
(``<name>@v<version>#<serial>``), and requests send that name as ``lora_path``. A new version is
loaded first; only once SGLang took it do requests switch to it (one dict entry), and the version
it replaces is retired. Requests already running keep the version they started with: a retired
version is unloaded from SGLang once no request of this engine uses it (when its last request
ends, and at every LoRA push or unload). SGLang's own unload also waits for the requests that use
it (``wait_for_unload``) but holds its LoRA lock meanwhile, which would stall the next push; hence
the wait happens here.

**Refusals.** An adapter SGLang refuses (``success=False``) was not registered: the previous
version still serves. With tensor parallelism, ranks that took it before another refused keep
its tensors unused until the engine closes (SGLang registers nothing it can unload then).

**Not over** ``sglang_nccl``: there SGLang's scheduler receives broadcasts into the model's own
parameters; a LoRA push over it is refused before anything is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_engines.errors import InvalidRequest, ManifestMismatch, WeightSyncError
from rollout_engines.types import LoraSpec
from rollout_engines.weights.lora import peft_adapter_config, receive_lora
from rollout_engines.weights.manifest import WeightManifest

from .runtime import SglangCallFailed, SglangLoraRuntime

if TYPE_CHECKING:
    from .engine import SglangEngine

logger = logging.getLogger("rollout_engines.sglang.lora")

#: ``lora_target_modules`` by default: the linear layers of a Llama/Qwen-style decoder.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: SGLang's fused layers and the checkpoint modules they hold (``get_normalized_target_modules``,
#: python/sglang/srt/lora/utils.py): naming one part gives SGLang buffers for all of them.
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: What a push carries is linear layers only (PEFT's ``lora_A``/``lora_B``), so SGLang's LoRA on
#: embeddings and the LM head (and its "all", which adds them) is not offered.
REFUSED_TARGETS = ("all", "embed_tokens", "lm_head")


def adaptable_modules(targets: Iterable[str]) -> set[str]:
    """The module names (last components) adapters may target, given SGLang's
    ``lora_target_modules``: each name, plus the other parts of the fused layer it belongs to."""
    out: set[str] = set()
    for t in targets:
        group = next((g for g, parts in PACKED.items() if t == g or t in parts), None)
        out |= {t} if group is None else {group, *PACKED[group]}
    return out


@dataclass(eq=False)
class LoadedLora:
    """One version of an adapter, registered with SGLang as ``sglang_name``."""

    name: str
    version: int
    sglang_name: str
    users: int = 0  # requests of this engine running on it
    retired: bool = False


class SglangLoras:
    """The adapters of one :class:`~rollout_engines_sglang.engine.SglangEngine`: receive, load into
    SGLang, select per request, retire (see the module docstring)."""

    def __init__(self, engine: SglangEngine, targets: Iterable[str]) -> None:
        self._engine = engine
        self.adaptable = adaptable_modules(targets)
        self.active: dict[str, LoadedLora] = {}
        self._retired: list[LoadedLora] = []
        self._serial = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def runtime(self) -> SglangLoraRuntime:
        runtime = self._engine.runtime
        assert isinstance(runtime, SglangLoraRuntime)
        return runtime

    # ---- per request ---------------------------------------------------------------------------
    def acquire(self, name: str) -> LoadedLora:
        """The version requests naming ``name`` run on now; hold it until :meth:`release`."""
        loaded = self.active.get(name)
        if loaded is None:
            raise InvalidRequest(f"LoRA adapter '{name}' is not loaded (loaded: {sorted(self.active) or 'none'}); "
                                 "push it with WeightSync.push_lora first")
        loaded.users += 1
        return loaded

    def release(self, loaded: LoadedLora) -> None:
        loaded.users -= 1
        if loaded.retired and loaded.users == 0:
            task = asyncio.ensure_future(self.sweep())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ---- receive, unload -------------------------------------------------------------------------
    async def receive(self, manifest: WeightManifest, transfer: Any) -> None:
        """Receive the push ``manifest`` (through ``transfer``, the engine's weight transfer), load
        it into SGLang, and switch requests to it."""

        spec = manifest.lora
        assert spec is not None
        what = f"LoRA '{spec.name}' v{manifest.version}"
        if transfer is None:
            raise WeightSyncError("sglang: no weight transfer initialised; connect_weight_sync() first")
        if transfer.control is not None:  # sglang_nccl
            reason = (f"{what}: LoRA adapters cannot be pushed over 'sglang_nccl' (SGLang receives those "
                      "into the model's own weights); push them over cuda_ipc, nccl, gloo, shm or disk")
            await asyncio.to_thread(transfer.control.verdict, manifest, reason)
            raise ManifestMismatch(reason)
        receiver = transfer.receiver

        def take() -> dict[str, Any]:
            return receive_lora(receiver, manifest, self._engine.expected_specs(), supported=self.adaptable,
                                hint="create the engine with them in lora_target_modules")

        tensors = await asyncio.to_thread(take)
        self._serial += 1
        loaded = LoadedLora(spec.name, manifest.version, f"{spec.name}@v{manifest.version}#{self._serial}")
        await self._load(loaded, spec, tensors, what)
        old = self.active.get(spec.name)
        self.active[spec.name] = loaded
        if old is not None:
            self._retire(old)
        await self.sweep()
        logger.info("%s loaded into SGLang as '%s'", what, loaded.sglang_name)

    async def _load(self, loaded: LoadedLora, spec: LoraSpec, tensors: Mapping[str, Any], what: str) -> None:
        import torch

        from .payloads import serialize_per_rank, stage_views

        runtime = self.runtime
        device = torch.device(self._engine._relay_device())
        _, flat, metadata = await asyncio.to_thread(stage_views, sorted(tensors.items()), None, device)
        payloads = serialize_per_rank(flat, metadata, runtime.tp_size, runtime.serialize)
        try:
            # Every rank has copied its part when this returns: the staging buffer may go.
            await runtime.load_lora_from_tensors(loaded.sglang_name, peft_adapter_config(spec), payloads)
        except SglangCallFailed as exc:
            raise ManifestMismatch(f"SGLang refused {what}, nothing changed: {exc}") from exc

    async def unload(self, name: str) -> None:
        old = self.active.pop(name, None)
        if old is not None:
            self._retire(old)
        await self.sweep()

    def _retire(self, loaded: LoadedLora) -> None:
        loaded.retired = True
        self._retired.append(loaded)

    async def sweep(self) -> None:
        """Unload from SGLang the retired versions no request of this engine uses."""
        for old in [r for r in self._retired if r.users == 0]:
            self._retired.remove(old)
            try:
                await self.runtime.unload_lora(old.sglang_name)
            except Exception:  # it only holds memory; an engine that is closing frees it anyway
                logger.warning("SGLang could not unload LoRA '%s' v%d ('%s')", old.name, old.version,
                               old.sglang_name, exc_info=True)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.active.clear()
        self._retired.clear()
