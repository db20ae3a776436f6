"""The worker extension: the core's weight receiver, hosted inside every vLLM worker.

vLLM mixes this class into its worker class (``worker_extension_cls``) in whatever process the
worker runs, and the driver calls its methods through ``collective_rpc``. Every name here starts
with ``roe_`` because vLLM refuses an extension whose attributes clash with the worker's (the CPU
worker already has ``update_weights``).

Arguments and results cross process boundaries by pickle, so they are JSON strings and plain
dicts, never tensors; errors come back as dicts too, and the driver raises the typed error.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from rollout_engines.errors import CapabilityError, ManifestMismatch, WeightSyncError
from rollout_engines.proxy import WireError, raise_for_workers
from rollout_engines.weights.copy_plan import PlannedLoader
from rollout_engines.weights.doorbell import DoorbellListener, has_store
from rollout_engines.weights.fp8 import SCALE_SUFFIX, Fp8Forms, is_fp8_form, quantize_named, read_block_config
from rollout_engines.weights.manifest import TensorSpec, TransportSpec, WeightManifest, manifest_from_wire
from rollout_engines.weights.receiver import WeightReceiver

from .checkpoint import checkpoint_specs, incomplete_groups, resolve_model_dir

logger = logging.getLogger("rollout_engines.vllm.worker")

#: Transports whose receiver reads into host memory; the loader copies to the device.
HOST_TRANSPORTS = {"gloo", "shm", "disk", "inproc", "http"}


def error_result(exc: BaseException) -> dict[str, Any]:
    """A failed worker call in the core's one error wire format (:class:`~rollout_engines.proxy.WireError`)."""
    return {"ok": False, **WireError.of(exc).model_dump()}


def parameter_sums(params: Iterable[torch.Tensor], chunk: int = 1 << 26) -> dict[str, float]:
    """The sum, the sum of absolute values and the element count of ``params``, in float64. Each
    tensor is summed in chunks of ``chunk`` elements: a whole 14B-shape embedding in float64 would
    need 4x its memory on a GPU that already holds the engine and the trainer's weights."""
    total, absolute, count = 0.0, 0.0, 0
    with torch.no_grad():
        for p in params:
            for part in p.detach().reshape(-1).split(chunk):
                d = part.float().double()  # float8 weights (FP8 engines) convert through float32
                total += float(d.sum())
                absolute += float(d.abs().sum())
            count += p.numel()
    return {"sum": total, "abs_sum": absolute, "numel": count}


def sleep_mode_allocations(tag: str) -> dict[str, int] | None:
    """How many allocations with ``tag`` vLLM's sleep-mode allocator holds in this process, and
    their bytes (None without sleep mode): a level-2 wake-up maps each again, one by one."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:  # noqa: BLE001 - a build without the allocator (CPU)
        return None
    instance = CuMemAllocator.instance
    if instance is None:
        return None
    sizes = [int(d.handle[1]) for d in instance.pointer_to_data.values() if d.tag == tag]
    return {"count": len(sizes), "bytes": sum(sizes), "largest": max(sizes, default=0)}


class VllmWeightTarget:
    """A :class:`~rollout_engines.weights.receiver.WeightTarget` over a running vLLM worker's model.

    Expected tensors come from the checkpoint (HF names, the engine's dtype). Loading goes through
    vLLM's own loader so fused and sharded parameters (tensor parallel) are filled as at start-up:
    ``reload_weights`` in checkpoint format where the platform repacks weights after loading (CPU:
    ``model.load_weights`` fails there after start-up), ``model.load_weights`` elsewhere.
    """

    def __init__(self, worker: Any, *, copy_plan: bool = True, fp8_reload: bool = False) -> None:
        self.worker = worker
        model_config = worker.model_config
        dtype = str(model_config.dtype).removeprefix("torch.")
        model_dir = resolve_model_dir(model_config.model)
        model = worker.model_runner.get_model()
        self.packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        from vllm.platforms import current_platform

        self.use_reload = current_platform.is_cpu() and hasattr(worker, "reload_weights")
        if self.use_reload and any(hasattr(m, "w13_weight") for m in model.modules()):
            raise CapabilityError(
                "vLLM on the CPU cannot update a mixture-of-experts model's weights in place: its "
                "reload_weights repacks the experts so that the model answers differently even given "
                "the very same weights (vLLM's own reload from the checkpoint does it too). Push into "
                "vLLM on a GPU, or start a new engine from a saved checkpoint"
            )
        self.use_copy_plan = copy_plan and not self.use_reload
        self.plan = PlannedLoader() if self.use_copy_plan else None
        #: An FP8 block engine (option ``weight_quantization``): pushes come in BF16 (quantized here)
        #: or already quantized; ``select`` picks the form a manifest is checked against.
        self.fp8: Any = None
        self._forms = Fp8Forms.of_checkpoint(model_dir, dtype)
        if self._forms is None:
            self._specs = checkpoint_specs(model_dir, runtime_dtype=dtype)
        else:
            self._specs = self._forms.bf16
            if not self.use_reload:
                from .fp8_apply import Fp8BlockApplier

                block = read_block_config(model_dir)
                assert block is not None
                self.fp8 = Fp8BlockApplier(worker, block, always_reload=fp8_reload)

    @property
    def quantized(self) -> frozenset[str]:
        """Names of the weights this engine holds in FP8 (empty unless it serves an FP8 copy)."""
        return self._forms.quantized if self._forms is not None else frozenset()

    def select(self, manifest: WeightManifest) -> None:
        """Check ``manifest`` against the form it comes in (FP8 engines: BF16, or FP8 with scales)."""
        if self._forms is not None:
            self._specs = self._forms.specs_for(t.name for t in manifest.tensors)

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def group_problems(self, manifest: WeightManifest) -> list[str]:
        names = {t.name for t in manifest.tensors}
        problems = self._forms.problems(names) if self._forms is not None else []
        if not self.use_reload:  # direct loading fills fused parameters slice by slice
            return problems
        return problems + incomplete_groups(names, self._specs, self.packed)

    def apply(self, named: Sequence[tuple[str, torch.Tensor]], *, owned: bool) -> None:
        if self.fp8 is not None:
            # Quantized layers: written (and quantized) straight into the running FP8 parameters.
            quantized = self.quantized
            quant = [(n, t) for n, t in named if n.removesuffix(SCALE_SUFFIX) in quantized]
            if quant:
                self.fp8.apply(quant)
                named = [(n, t) for n, t in named if n.removesuffix(SCALE_SUFFIX) not in quantized]
            if not named:
                return
        elif self._forms is not None and not is_fp8_form(n for n, _ in named):
            named = list(quantize_named(named))  # reload_weights takes the checkpoint's (FP8) form
        if not owned and not self.use_copy_plan:
            # Views of a transport slot (or of the trainer's tensors) that change after this call:
            # vLLM's loaders may keep what they are given.
            named = [(n, t.clone()) for n, t in named]
        if self.use_reload:
            self.worker.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
            if any(n.endswith("embed_tokens.weight") for n, _ in named):
                self._refresh_tied_head()
            return
        model = self.worker.model_runner.get_model()

        def load(items: list[tuple[str, torch.Tensor]]) -> None:
            model.load_weights(iter(items))

        if self.plan is None:
            load(list(named))
            return
        self.plan.apply(named, load, owned=owned)

    def _refresh_tied_head(self) -> None:
        """Rebuild a tied LM head's packed GEMM weights after the embedding was reloaded.

        On CPU the head multiplies through a oneDNN handle packed from the weight at load time. With
        tied embeddings the checkpoint has no ``lm_head.weight``, so a reload refills the shared
        parameter but never re-packs the head: logits would keep using the old embedding.
        """
        model = self.worker.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        method = getattr(head, "quant_method", None)
        if head is None or embed is None or method is None or head is embed:
            return
        if getattr(head, "weight", None) is not getattr(embed, "weight", None):
            return  # not tied: the head has its own checkpoint tensor and reloads itself
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.worker.vllm_config):
            method.process_weights_after_loading(head)


class _RejectAll:
    """A target that accepts nothing: the receiver rejects the update and drains its buckets, so
    the sender and the other workers stay in step (used for problems found beyond the manifest's
    names, shapes and dtypes)."""

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        return {}

    def apply(self, named: Sequence[tuple[str, torch.Tensor]], *, owned: bool) -> None:
        raise AssertionError("unreachable: every tensor is rejected before apply")


class WorkerExtension:
    """Methods vLLM adds to each of its workers (called via ``collective_rpc``)."""

    #: Set by the vLLM worker this class is mixed into.
    model_runner: Any

    def roe_worker_info(self) -> dict[str, Any]:
        """Who this worker is, and (sleep mode) how many allocations its weights take."""
        info: dict[str, Any] = {"pid": os.getpid(), "rank": int(getattr(self, "rank", 0)),
                                "device": str(getattr(self, "device", "cpu"))}
        allocations = sleep_mode_allocations("weights")
        if allocations is not None:
            info["weight_allocations"] = allocations
        return info

    def roe_param_checksum(self) -> dict[str, float]:
        """Sums over this worker's parameters (to compare weights where greedy tokens are not
        reproducible, e.g. real-size models on a GPU). Meaningless on CPU, where vLLM repacks
        linear weights out of their parameters."""
        return parameter_sums(p for _, p in self.model_runner.get_model().named_parameters())

    def _roe_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_roe")
        if state is None:
            # "lock": held by every receive, whether by RPC or by the doorbell's thread
            state = self.__dict__["_roe"] = {"receiver": None, "target": None, "door": None, "lock": threading.Lock()}
        return state

    def _roe_stop_door(self) -> None:
        state = self._roe_state()
        if state["door"] is not None:
            state["door"].close()
            state["door"] = None

    def roe_init_weight_transfer(self, spec_json: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Open this worker's receiver of a weight-sync session (blocks until connected).

        ``options``: ``mode`` ('staged' or 'inplace'), ``copy_plan`` (bool), ``doorbell`` (the name of
        the host's doorbell: this worker also receives when rung through the session's store, see
        :mod:`rollout_engines.weights.doorbell`; the answer's ``door`` says it listens)."""
        options = options or {}
        mode = options.get("mode", "staged")
        try:
            spec = TransportSpec.model_validate_json(spec_json)
            state = self._roe_state()
            self._roe_stop_door()
            if state["target"] is None:
                state["target"] = VllmWeightTarget(self, copy_plan=bool(options.get("copy_plan", True)),
                                                   fp8_reload=options.get("fp8_apply") == "reload")
            if state["receiver"] is not None:
                state["receiver"].close()
            if mode == "inplace" and state["target"].use_reload:
                # A reload processes each module once its tensors arrived; per-bucket reloads would
                # see modules split across buckets half loaded. Stage the whole update instead.
                logger.info("weight_apply_mode 'inplace' is not possible with reload_weights; staging")
                mode = "staged"
            fp8 = state["target"].fp8
            if mode == "inplace" and fp8 is not None and not fp8.direct(state["target"].quantized):
                logger.info("FP8 weights load through reload_weights here (see fp8_apply); staging updates")
                mode = "staged"
            device = "cpu" if spec.transport in HOST_TRANSPORTS else getattr(self, "device", "cpu")
            rank = int(getattr(self, "rank", 0))
            receiver = WeightReceiver(state["target"], device=device, mode=mode, label=f"vllm worker {rank}")  # type: ignore[arg-type]
            receiver.connect(spec, local_rank=rank)
            state["receiver"] = receiver
            door = options.get("doorbell")
            if isinstance(door, str) and has_store(spec):
                try:
                    state["door"] = DoorbellListener(
                        spec, door, rank=spec.rank_offset + rank, receive=self._roe_door_receive, lock=state["lock"],
                        setup=_device_setter(getattr(self, "device", None)),
                    )
                except Exception as exc:  # the driver then pushes through the RPC
                    logger.warning("weight doorbell not started in worker %d: %s", rank, exc)
            return {"ok": True, "rank": spec.rank_offset + rank, "door": state["door"] is not None}
        except BaseException as exc:
            logger.warning("weight transfer init failed in worker: %s", exc)
            return error_result(exc)

    def roe_receive_weights(self, wire: dict[str, Any] | str) -> dict[str, Any]:
        """Receive one update (``wire``: :func:`~rollout_engines.weights.manifest.manifest_to_wire`'s
        form, or a manifest's JSON); returns ``{"ok": True, "version": v}`` or the error as a dict."""
        with self._roe_state()["lock"]:
            return self._roe_receive(wire)

    def _roe_door_receive(self, wire: dict[str, Any]) -> dict[str, Any]:
        """A receive the doorbell handed this worker (its thread holds the receive lock): a LoRA
        push (its wire carries ``lora_install``) or a full push."""
        if "lora_install" not in wire:
            return self._roe_receive(wire)
        result = self._roe_receive_lora(wire)
        device = getattr(self, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            # The adapter's copies and vLLM's activation of it ran on this thread's stream: done
            # before the answer lets requests run on the worker's own.
            torch.cuda.synchronize(device)
        return result

    def _roe_receive(self, wire: dict[str, Any] | str) -> dict[str, Any]:
        state = self._roe_state()
        receiver: WeightReceiver | None = state["receiver"]
        if receiver is None:
            return error_result(WeightSyncError("no weight transfer initialised in this worker; connect first"))
        try:
            if isinstance(wire, str):
                manifest = WeightManifest.model_validate_json(wire)
            else:
                manifest = manifest_from_wire(wire)
            target: VllmWeightTarget = state["target"]
            target.select(manifest)
            problems = target.group_problems(manifest)
            if problems:
                receiver.target = _RejectAll()
                try:
                    receiver.receive(manifest)
                except ManifestMismatch:
                    pass
                finally:
                    receiver.target = target
                raise ManifestMismatch(
                    f"weight update v{manifest.version} rejected before applying anything: "
                    + "; ".join(problems[:5])
                    + ". vLLM loads fused modules whole: send every tensor of a module, or none"
                )
            version = receiver.receive(manifest)
            return {"ok": True, "version": version, "timings": receiver.last_timings}
        except BaseException as exc:
            if not isinstance(exc, ManifestMismatch):
                logger.warning("weight update failed in worker: %s", exc)
            return error_result(exc)

    def roe_lora_setup(self) -> None:
        """Prepare this worker for LoRA requests (before the first adapter is registered)."""
        from .lora import worker_lora_setup

        worker_lora_setup(self)

    def roe_receive_lora(self, wire: dict[str, Any]) -> dict[str, Any]:
        """Receive a LoRA adapter push (``wire``: a manifest with ``lora`` set, and beside it
        ``lora_install``: ``path``, ``key``, ``lora_id``, ``retire``) through this worker's
        receiver, leaving the model untouched; each worker registers the adapter with its vLLM
        LoRA manager as ``key`` / ``lora_id`` from the received tensors, with the config the driver
        wrote into the folder ``path`` (:func:`.lora.worker_install_lora`). ``installed`` False:
        rank 0 writes the tensors into that folder and the driver registers it through vLLM's
        ``add_lora``. First it removes the retired versions ``retire`` (vLLM ids no request
        uses any more), whatever becomes of this push. The doorbell's thread runs the same receive
        when the engine rings it (:meth:`_roe_door_receive`)."""
        with self._roe_state()["lock"]:  # not beside a receive by the doorbell
            return self._roe_receive_lora(wire)

    def _roe_receive_lora(self, wire: dict[str, Any]) -> dict[str, Any]:
        from rollout_engines.weights.lora import (
            install_started,
            receive_lora,
            with_install_time,
            write_adapter_weights,
        )

        from .lora import worker_install_lora, worker_lora_modules, worker_remove_loras

        state = self._roe_state()
        receiver: WeightReceiver | None = state["receiver"]
        if receiver is None:
            return error_result(WeightSyncError("no weight transfer initialised in this worker; connect first"))
        try:
            install = wire["lora_install"]
            path, key, lora_id = str(install["path"]), str(install.get("key", "")), int(install.get("lora_id", 0))
            worker_remove_loras(self, [int(i) for i in install.get("retire", ())])
            manifest = manifest_from_wire(wire)
            if manifest.lora is None:
                raise ManifestMismatch("a LoRA receive needs a manifest with 'lora' set")
            tensors = receive_lora(receiver, manifest, state["target"].expected_specs(), supported=worker_lora_modules(self),
                                   hint="vLLM has no LoRA layer for them in this model")
            started = install_started()
            installed = bool(key) and worker_install_lora(self, tensors, key=key, lora_id=lora_id, path=path)
            if not installed and int(getattr(self, "rank", 0)) == 0:  # for the driver's add_lora
                write_adapter_weights(path, tensors)
            timings = with_install_time(receiver.last_timings, started)
            return {"ok": True, "version": manifest.version, "installed": installed, "timings": timings}
        except BaseException as exc:
            if not isinstance(exc, ManifestMismatch):
                logger.warning("LoRA receive failed in worker: %s", exc)
            return error_result(exc)

    def roe_remove_lora(self, lora_ids: list[int]) -> None:
        """Remove the adapters ``lora_ids`` from this worker's vLLM LoRA manager, with the copies kept
        for them (absent ones: no-op)."""
        from .lora import worker_remove_loras

        worker_remove_loras(self, list(lora_ids))

    def roe_fp8_reloads(self) -> list[int] | None:
        """The FP8 updates this worker loaded through vLLM's ``reload_weights`` (each one's number of
        quantized weights); None where it serves no FP8 copy or has no weight transfer yet."""
        target = self._roe_state()["target"]
        fp8 = getattr(target, "fp8", None)
        return None if fp8 is None else list(fp8.reload_sizes)

    def roe_close_weight_transfer(self) -> None:
        state = self._roe_state()
        self._roe_stop_door()
        if state["receiver"] is not None:
            try:
                state["receiver"].close()
            finally:
                state["receiver"] = None


def _device_setter(device: Any) -> Any:
    """What the doorbell's thread runs first: a CUDA worker's device is per thread."""
    if device is None or torch.device(device).type != "cuda":
        return None
    return lambda: torch.cuda.set_device(torch.device(device))


def raise_worker_error(results: list[dict[str, Any]], what: str, *, update: bool = False) -> None:
    """Raise the typed error for the first failed worker of a ``collective_rpc`` call, by the core's
    one rule for partial failures (:func:`rollout_engines.proxy.raise_for_workers`): ``update``: the
    call applied weights, so workers that succeeded while others failed leave the engine with
    mismatched shards (:class:`WeightsInvalidated`)."""
    raise_for_workers(results, what, applies_weights=update, worker="vLLM worker")
