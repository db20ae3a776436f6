"""LoRA adapters on the vLLM backend: received like weights, served by vLLM's own LoRA layers.

A push (:meth:`~rollout_engines.weights.session.WeightSync.push_lora`) reaches every worker through
the weight-sync session's transport, as a full push does (:func:`rollout_engines.weights.lora.receive_lora`
on each worker's receiver), and starts there as a full push does: through the workers' doorbell
(option ``direct_receive``, :mod:`rollout_engines.weights.doorbell`) while no request runs, else
through vLLM's ``collective_rpc``. Each worker checks the manifest against the base model's checkpoint
names and the layers vLLM can adapt before it takes any bucket; a refused adapter is drained (the
session stays in step) and raises :class:`ManifestMismatch` with nothing installed. The driver
prepares a folder in the engine's private temporary directory (mode 0700) with the adapter's
``adapter_config.json`` (once per config: versions with the same config share it), and in the same call that received the adapter every worker registers it
with its vLLM LoRA manager from the received tensors (:func:`worker_install_lora`: vLLM's own
``add_lora`` with the tensors handed over instead of read from a folder) under a new
``lora_int_id`` and a new ``lora_name``. Only then does the driver retire the version it replaces.
vLLM keys its adapter cache on the id and its prefix cache on the name and path, so two versions
never share cached state.

vLLM builds an adapter again whenever it is activated after an LRU eviction of its cache; each
worker keeps a copy of what it received (:data:`RECEIVED`) and answers that build from it, so
the tensors never go to disk (where a vLLM lacks the manager this relies on, rank 0 writes them
into the folder and the driver registers it through ``add_lora``). A retired version is removed
from vLLM and its copies deleted (its folder too, once no version reads it), once no running request uses it: by the workers in
the next push's call, or at an unload or close.

On CPU, vLLM 0.32 adds the last adapter slot's delta to base-model requests batched with LoRA
requests; :func:`fix_cpu_no_lora_rows` corrects that in the workers before the first adapter is
registered.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rollout_engines.errors import InvalidRequest, ManifestMismatch
from rollout_engines.types import LastReceive, ReceiveTimings
from rollout_engines.weights.lora import ADAPTER_WEIGHTS, peft_adapter_config, write_adapter_config
from rollout_engines.weights.manifest import WeightManifest

logger = logging.getLogger("rollout_engines.vllm.lora")

# ---- worker side (inside each vLLM worker, called through the worker extension) -----------------------
def _no_lora_rows_leak() -> bool:
    """Whether vLLM's PyTorch LoRA ops (the CPU path) apply an adapter to rows marked "no LoRA"
    (index -1): they index the stacked adapters with it, which selects the last slot."""
    from vllm.lora.ops.torch_ops import lora_ops

    out = torch.zeros(1, 1)
    lora_ops.bgmv_shrink(torch.ones(1, 1), torch.ones(1, 1, 1, 1), out, torch.tensor([-1]), 1.0)
    return bool(out.abs().sum() != 0)


def _skipping_no_lora_rows(op: Any) -> Any:
    """``op`` (a bgmv op: inputs, weights, output, indices, ...) with the inputs of rows whose index
    is -1 zeroed and the index clamped: those rows get exactly nothing added."""

    def wrapped(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, indices: torch.Tensor,
                *args: Any, **kwargs: Any) -> Any:
        skip = indices < 0
        if bool(skip.any()):
            inputs = inputs.masked_fill(skip.view(-1, *([1] * (inputs.dim() - 1))), 0)
            indices = indices.clamp(min=0)
        return op(inputs, weights, output, indices, *args, **kwargs)

    wrapped.roe_skips_no_lora_rows = True  # type: ignore[attr-defined]
    return wrapped


def fix_cpu_no_lora_rows() -> bool:
    """Make base-model requests batched with LoRA requests get base outputs on vLLM's CPU path.

    vLLM 0.32's PyTorch bgmv ops (used by ``PunicaWrapperCPU``) gather ``weights[indices]`` with
    the no-LoRA index -1, which adds the last adapter slot's delta to base-model rows (vllm#48421,
    unmerged at 0.32). Patched here, in the worker, only where that happens; returns whether it did."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops.bgmv_shrink, "roe_skips_no_lora_rows", False) or not _no_lora_rows_leak():
        return False
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        fixed = _skipping_no_lora_rows(getattr(lora_ops, name))
        setattr(lora_ops, name, fixed)  # the sgmv (prefill) ops call these module globals
        if hasattr(punica_cpu, name):
            setattr(punica_cpu, name, fixed)
    logger.info("vLLM's CPU LoRA ops patched so that base-model rows skip the adapters (vllm#48421)")
    return True


def _skipping_clean_resets(module: Any, clean: set[int]) -> None:
    """Make ``module`` (a vLLM LoRA layer) skip zeroing an adapter slot that is all zeros already.

    vLLM's ``activate_adapter`` zeroes the slot of every LoRA layer the adapter does not adapt, and
    each ``set_lora`` zeroes the slot before it copies in: for a q/v adapter of a 16-layer model,
    some 200 small fills per activation, most of them of slots no adapter ever wrote. ``clean``
    holds the slots this layer's ``reset_lora`` zeroed and no ``set_lora`` wrote since; a reset of
    one of them does nothing. A slot starts unknown, so it is zeroed at its first reset as before.
    Where the layer's reset is vLLM's plain one (every slice's A and B zeroed), it is one
    ``torch._foreach_zero_`` call."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    reset, assign = module.reset_lora, module.set_lora
    if getattr(type(module), "reset_lora", None) is BaseLinearLayerWithLoRA.reset_lora:
        def reset(index: int) -> None:
            torch._foreach_zero_([t[index] for t in (*module.lora_a_stacked, *module.lora_b_stacked)])

    def reset_lora(index: int) -> None:
        if index not in clean:
            reset(index)
            clean.add(index)

    def set_lora(index: int, *args: Any, **kwargs: Any) -> Any:
        try:  # it calls reset_lora first, the one above: a slot known to be zero is not zeroed again
            return assign(index, *args, **kwargs)
        finally:
            clean.discard(index)

    module.reset_lora, module.set_lora = reset_lora, set_lora


def worker_lora_setup(worker: Any) -> None:
    """Prepare a worker for LoRA requests: on CPU, the fix above; on every device, LoRA layers
    that skip zeroing slots that are zero (:func:`_skipping_clean_resets`). A wake-up forgets
    which slots are zero (the memory of a level-2 sleep comes back undefined)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        fix_cpu_no_lora_rows()
    adapters = getattr(getattr(worker.model_runner, "lora_manager", None), "_adapter_manager", None)
    modules = getattr(adapters, "modules", None)
    if not isinstance(modules, dict) or getattr(worker, "roe_clean_slots", None) is not None:
        return
    slots: list[set[int]] = []
    for module in modules.values():
        if callable(getattr(module, "reset_lora", None)) and callable(getattr(module, "set_lora", None)):
            slots.append(set())
            _skipping_clean_resets(module, slots[-1])
    worker.roe_clean_slots = slots
    wake_up = getattr(worker, "wake_up", None)
    if wake_up is None:
        return

    def forgetting_wake_up(*args: Any, **kwargs: Any) -> Any:
        for clean in slots:
            clean.clear()
        return wake_up(*args, **kwargs)

    worker.wake_up = forgetting_wake_up


def worker_lora_modules(worker: Any) -> list[str]:
    """The module names an adapter may target in this worker's model: vLLM's LoRA-wrapped modules,
    packed ones (``qkv_proj``) as their checkpoint parts (``q_proj``, ``k_proj``, ``v_proj``)."""
    manager = getattr(worker.model_runner, "lora_manager", None)
    adapters = getattr(manager, "_adapter_manager", None)
    if adapters is None:
        return []
    packed = dict(getattr(adapters, "packed_modules_mapping", {}) or {})
    names: list[str] = []
    for module in adapters.supported_lora_modules:
        if module == "experts":
            continue  # fused MoE experts: not a per-module PEFT target
        names.extend(packed.get(module, [module]))
    return sorted(set(names))


#: This worker's received adapters, by vLLM id: the tensors as received (PEFT names, on the device
#: they arrived on), from which vLLM builds each adapter (at its push, and again after its cache
#: evicted it) in place of a folder read.
RECEIVED: dict[int, dict[str, torch.Tensor]] = {}


def _received_model_cls(base: Any) -> Any:
    """vLLM's LoRA model class ``base`` with its folder load answered from :data:`RECEIVED` for the
    adapters this worker received (others load from their folders as before)."""
    import inspect

    accepted = inspect.signature(base.from_lora_tensors).parameters

    class ReceivedLoRAModel(base):  # type: ignore[misc]
        roe_received = True

        @classmethod
        def from_local_checkpoint(cls, lora_dir: str, expected_lora_modules: Any, peft_helper: Any, **kwargs: Any) -> Any:
            tensors = RECEIVED.get(kwargs.get("lora_model_id"))  # type: ignore[arg-type]
            if tensors is None:
                return super().from_local_checkpoint(lora_dir, expected_lora_modules, peft_helper=peft_helper, **kwargs)
            kwargs = {k: v for k, v in kwargs.items() if k in accepted and k != "device"}
            device = next(iter(tensors.values())).device
            # vLLM scales the B tensors it is given in place (it only reads the A tensors): copies
            # of those, where they are
            given = {n: t if "lora_A" in n or "lora_embedding_A" in n else t.clone() for n, t in tensors.items()}
            model = base.from_lora_tensors(tensors=given, peft_helper=peft_helper, device=str(device), **kwargs)
            return _device_first(model, device)

    return ReceivedLoRAModel


#: The name of the empty leading layer :func:`_device_first` adds (no module is named so).
DEVICE_PROBE = "roe.device-probe"


def _device_first(model: Any, device: torch.device) -> Any:
    """``model`` (a vLLM ``LoRAModel``) with an empty layer first in its ``loras``.

    After packing, vLLM reads the adapter's device from its first layer's ``lora_a``; where that
    layer is packed (``qkv_proj`` of a q/v adapter) it reads the first tensor of the list instead
    and takes its ``str()``: a device sync and a formatted print in every build. Led by an empty
    layer no module is named after, that read is the empty tensor's ``.device``; vLLM selects
    layers by module name, so nothing else sees it."""
    from vllm.lora.lora_weights import LoRALayerWeights

    empty = torch.empty(0, device=device)
    model.loras = {DEVICE_PROBE: LoRALayerWeights(DEVICE_PROBE, 1, 1, empty, empty.clone()), **model.loras}
    return model


def worker_remove_loras(worker: Any, lora_ids: list[int]) -> None:
    """Remove the adapters ``lora_ids`` from this worker's vLLM LoRA manager (absent ones: no-op),
    and the copies kept for them."""
    manager: Any = getattr(worker.model_runner, "lora_manager", None)
    for lora_id in lora_ids:
        if manager is not None:
            manager.remove_adapter(lora_id)
        RECEIVED.pop(lora_id, None)


def worker_install_lora(worker: Any, tensors: dict[str, torch.Tensor], *, key: str, lora_id: int, path: str) -> bool:
    """Register a received adapter with this worker's vLLM LoRA manager straight from its tensors,
    in the call that received them.

    This is vLLM's own ``add_lora`` (``LRUCacheWorkerLoRAManager.add_adapter``: the config read
    from ``path`` and checked, the name mapping, the cache's eviction and the activation), with the
    load of the tensors swapped: where vLLM reads them from the folder into pinned host memory, the
    manager is handed copies of the received tensors, left on the device they arrived on (an
    adapter cache of ``max_cpu_loras`` small adapters). The tensors stay in :data:`RECEIVED` for
    vLLM to build the adapter again after an eviction, so none are written to disk. It saves the driver's
    ``add_lora`` and ``remove_lora`` round trips through the engine core and the folder's write and
    read. False where this vLLM lacks the manager this relies on: rank 0 then writes the tensors
    into the folder and the driver registers it through ``add_lora``."""
    from vllm.lora.request import LoRARequest

    manager = getattr(worker.model_runner, "lora_manager", None)
    base: Any = getattr(manager, "_lora_model_cls", None)
    if manager is None or base is None or not hasattr(base, "from_lora_tensors") or not tensors:
        return False
    if not getattr(base, "roe_received", False):
        manager._lora_model_cls = _received_model_cls(base)
    RECEIVED[lora_id] = tensors
    try:
        manager.add_adapter(LoRARequest(lora_name=key, lora_int_id=lora_id, lora_path=path))
    except BaseException:
        RECEIVED.pop(lora_id, None)
        raise
    return True


# ---- driver side -----------------------------------------------------------------------------------------
@dataclass(eq=False)
class LoadedLora:
    """One version of an adapter registered with vLLM."""

    name: str
    version: int
    request: Any  # vllm.lora.request.LoRARequest
    path: Path


class VllmLoras:
    """The adapters of one :class:`~rollout_engines_vllm.engine.VllmEngine`: receive, register with
    vLLM, select per request, retire."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        #: Private to this engine (mkdtemp: mode 0700); removed at close, or at exit at the latest.
        self._dir = tempfile.TemporaryDirectory(prefix="roe-vllm-lora-")
        self.root = Path(self._dir.name)
        self.active: dict[str, LoadedLora] = {}
        self._retired: list[LoadedLora] = []
        self._next_id = 1
        self._ready = False
        #: Versions share the folder of their config (only ``adapter_config.json`` is in it) until a
        #: push is registered through the fallback, whose folders hold each version's weights.
        self._shared_folders = True

    # -- selection (under the engine's request lock, so a retire sees every request that chose a version)
    def select(self, name: str) -> LoadedLora:
        loaded = self.active.get(name)
        if loaded is None:
            raise InvalidRequest(f"LoRA adapter '{name}' is not loaded (loaded: {sorted(self.active) or 'none'})")
        return loaded

    def _in_use(self) -> set[int]:
        engine = self._engine
        with engine._seqs_lock:
            return {id(q.lora) for q in engine._seqs.values() if q.lora is not None}

    # -- receive
    async def setup(self) -> None:
        """Prepare the workers, once, before the first adapter is registered with vLLM (so before
        any LoRA request can run)."""
        if not self._ready:
            await self._engine._rpc("roe_lora_setup")
            self._ready = True

    async def receive(self, manifest: WeightManifest) -> None:
        from vllm.lora.request import LoRARequest

        from .worker_ext import raise_worker_error

        spec = manifest.lora
        assert spec is not None
        await self.setup()
        lora_id, self._next_id = self._next_id, self._next_id + 1
        key = f"{spec.name}-v{manifest.version}-{lora_id}"
        path = self._folder(spec, key)
        what = f"LoRA '{spec.name}' v{manifest.version}"
        timeout = manifest.timeout_s * (len(manifest.buckets) + 2)
        # Retired versions no request uses: the workers remove them from vLLM in the same call.
        in_use = self._in_use()
        retire = [r for r in self._retired if id(r) not in in_use]
        install = {"path": str(path), "key": key, "lora_id": lora_id, "retire": [r.request.lora_int_id for r in retire]}
        t0 = time.perf_counter()
        results, direct = await self._engine._to_workers(manifest, "roe_receive_lora", timeout=timeout,
                                                         extra={"lora_install": install})
        rpc_s = time.perf_counter() - t0
        for gone in retire:
            self._retired.remove(gone)
        self._drop_folders([r.path for r in retire], keep=path)
        request = LoRARequest(lora_name=key, lora_int_id=lora_id, lora_path=str(path))
        try:
            raise_worker_error(results, what)
            if not all(r.get("installed") for r in results):  # registered through vLLM's add_lora instead
                self._shared_folders = False  # later versions: a folder each, for their weights
                if not (path / ADAPTER_WEIGHTS).is_file():
                    raise ManifestMismatch(f"{what}: no worker wrote the adapter folder")
                llm = self._engine.async_llm
                try:
                    await self._engine._on_loop(lambda: llm.add_lora(request))
                except Exception as exc:
                    raise ManifestMismatch(f"vLLM refused {what}: {exc}") from exc
        except BaseException:
            with contextlib.suppress(Exception):  # a worker may have installed it before another failed
                await self._engine._rpc("roe_remove_lora", [lora_id], timeout=manifest.timeout_s)
            self._drop_folders([path])
            raise
        self._engine._last_receive = LastReceive(
            version=manifest.version, rpc_s=round(rpc_s, 6), direct=direct,
            workers=[ReceiveTimings.of(r.get("timings")) for r in results if isinstance(r, dict)],
        )
        loaded = LoadedLora(spec.name, manifest.version, request, path)
        with self._engine._seqs_lock:
            old = self.active.get(spec.name)
            self.active[spec.name] = loaded
        if old is not None:  # removed from vLLM by the next push, or by sweep (unload, close)
            self._retired.append(old)
        logger.info("LoRA '%s' v%d installed (vLLM id %d)", spec.name, manifest.version, lora_id)

    async def unload(self, name: str) -> None:
        with self._engine._seqs_lock:
            old = self.active.pop(name, None)
        if old is not None:
            self._retired.append(old)
        await self.sweep()

    async def sweep(self) -> None:
        """Remove retired versions that no running request uses from vLLM, and their folders."""
        in_use = self._in_use()
        gone = [r for r in self._retired if id(r) not in in_use]
        if not gone:
            return
        for old in gone:
            self._retired.remove(old)
        if self._engine.async_llm is not None:
            try:
                await self._engine._rpc("roe_remove_lora", [r.request.lora_int_id for r in gone], timeout=60)
            except Exception:  # vLLM's LRU cache evicts them in time; the folders go regardless
                logger.warning("vLLM could not remove LoRA versions %s", [(r.name, r.version) for r in gone],
                               exc_info=True)
        self._drop_folders([r.path for r in gone])

    def _folder(self, spec: Any, key: str) -> Path:
        """The folder vLLM reads the version ``key`` of adapter ``spec`` from: its config's, shared
        by the versions with the same config (vLLM tells versions apart by name and id, also in
        its prefix cache), made once; with the fallback, one per version."""
        config = peft_adapter_config(spec, str(self._engine.config.model))
        if self._shared_folders:
            digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
            path = self.root / f"{spec.name}-{digest}"
        else:
            path = self.root / key
        if not path.is_dir():
            path.mkdir(mode=0o700)
            write_adapter_config(path, spec, config=config)  # every worker reads it
        return path

    def _drop_folders(self, paths: list[Path], keep: Path | None = None) -> None:
        """Delete the folders ``paths`` that no loaded version (nor ``keep``) reads any more."""
        used = {r.path for r in (*self.active.values(), *self._retired)} | ({keep} if keep else set())
        for path in set(paths) - used:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        self.active.clear()
        self._retired.clear()
        self._dir.cleanup()
