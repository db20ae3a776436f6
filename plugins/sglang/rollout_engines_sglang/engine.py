"""``SglangEngine``: SGLang's in-process ``sglang.Engine`` behind the core's :class:`Engine`.

Generation goes through ``async_generate`` with token ids (prompts and chats are tokenized here,
so completions carry their prompt ids); see :mod:`.translate` for the sampling mapping.
``reset_prefix_cache`` is ``flush_cache``, ``sleep``/``wake_up`` are ``release_memory_occupation``
/ ``resume_memory_occupation`` with the same tags.

**Async RL** (with SGLang's in-process runtime, :class:`~.runtime.SglangStreamingRuntime`): every
request runs as SGLang's stream (``async_generate(stream=True)``) with one SGLang ``rid`` per
prompt x sample (the request's ``request_ids``), so each token is tagged with the weight version
current when it arrived, :meth:`stream` yields the new tokens of each chunk, and :meth:`abort` is
SGLang's ``abort_request(rid)`` (aborted requests end with their tokens so far). Pause modes:

* ``wait``: new requests are held; returns once those in flight are done (then SGLang is paused
  ``in_place``, as the plain pause always did).
* ``abort``: SGLang's ``pause_generation(mode="abort")`` (aborts every request, returns once none
  runs).
* ``keep``: SGLang's ``pause_generation(mode="abort")``, and each sequence it ended is suspended
  here, not finished: on resume it goes on as a new SGLang request (its own rid plus ``~k``) with
  prompt + tokens so far as input and the rest of its token budget, so SGLang prefills it under
  the weights current then and the tokens after the switch are what the new weights make from
  prompt + tokens so far (what ``continue_from`` gives). Neither of SGLang's own modes that keep
  requests can take a push: a flush of the prefix cache fails while requests are paused
  ``in_place`` or wait retracted (``Scheduler.flush_cache`` needs an idle scheduler and an empty
  waiting queue), and without the flush a retracted request can re-prefill from blocks cached
  under the old weights. Tokens read before resume are tagged with the version of the pause;
  resume first reads the last chunk of every suspended sequence (bounded). Aborting a suspended
  sequence (or a ``pause("abort")`` while paused in ``keep``) ends it at once with its tokens so
  far. Stop strings are matched by SGLang within each request, so one that straddles the
  resubmission is not seen.

``continue_from`` sends prompt + earlier tokens as ``input_ids`` and puts the earlier tokens (with
their logprobs and weight versions) in front of the new ones. A runtime without streaming (the
remote plugin's HTTP one) keeps the plain path: none of these capabilities are declared then.

**Sleep releases weights.** SGLang frees the weights' memory on sleep and gives back
uninitialised memory on wake (unless ``enable_weights_cpu_backup=True``), so the engine declares
``weights_kept_on_sleep=False``: after sleeping with the ``weights`` tag the core refuses
generation with :class:`~rollout_engines.errors.WeightsInvalidated` until a complete push.

**Weights, per transport** (one :class:`~rollout_engines.weights.manifest.WeightManifest` per
update; the whole manifest is validated against the checkpoint's names, shapes and the engine's
dtype before anything is applied):

* ``sglang_nccl``: SGLang's scheduler (every TP rank) joins the trainer's NCCL group
  (``init_weights_update_group``) and receives one flattened broadcast per bucket
  (``update_weights_from_distributed(load_format="flattened_bucket")``); see :mod:`.transport`.
* ``disk``: the core's ``disk`` receiver waits for and checks every bucket file, then SGLang loads
  the update directory (``update_weights_from_disk``).
* ``cuda_ipc``, ``nccl``, ``gloo``, ``shm``, ``inproc``: the core's receiver for that transport runs
  in this (host) process on ``relay_device``; each bucket is copied into a staging buffer there and
  handed to every TP rank over CUDA IPC with ``update_weights_from_tensor`` (one payload per rank).
  With option ``copy_plan`` (on by default) SGLang starts with the plugin's custom weight loader
  (:mod:`.loader`) and each bucket goes to it: the first push of a name runs SGLang's
  ``load_weights`` while recording where it lands, later pushes copy straight into the parameters.
  Without it, or over a runtime not started with that loader, SGLang's own
  ``load_format="flattened_bucket"`` loads each bucket through ``load_weights``. With option
  ``forward_buckets`` (on by default) a ``cuda_ipc`` bucket of the trainer's
  own GPU tensors is forwarded to the loader, not staged: it opens the trainer's memory itself
  (see :class:`_RelayTarget`). With option ``direct_receive`` (on by default; ``shm`` and
  ``cuda_ipc``, one TP rank) SGLang's scheduler process becomes a receiver of the session itself
  after the first update: the engine hands it later updates through a doorbell on the weight-sync
  store (:mod:`rollout_engines.weights.doorbell`, a thread there, see :mod:`.loader`) and it reads
  the trainer's buckets straight into the parameters, with no relay and no
  ``update_weights_from_tensor``, while no request runs: requests that come meanwhile wait until
  the update is loaded.

SGLang applies updates in place. If an update fails after any bucket reached SGLang, the engine
refuses to generate (``WeightsInvalidated``) until the next complete push.

**LoRA adapters** (``enable_lora``): a ``push_lora`` is received like a relayed update and loaded
with SGLang's ``load_lora_adapter_from_tensors`` under a name per version; requests send that name
as ``lora_path``. See :mod:`.lora`.

For :meth:`weight_receivers` an SGLang engine is one receiver whatever its TP size: the host
process relays, and on ``sglang_nccl`` the TP ranks are laid out by the transport itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import statistics
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from rollout_engines.backend_kit import (
    PrefixCacheTracker,
    check_continuations,
    check_passed_options,
    validate_prompts,
)
from rollout_engines.engine import Capabilities, Engine
from rollout_engines.errors import (
    BackendNotInstalled,
    CapabilityError,
    EngineUnavailable,
    InvalidRequest,
    ManifestMismatch,
    WeightsInvalidated,
    WeightSyncError,
)
from rollout_engines.proxy import raise_for_workers
from rollout_engines.types import (
    MAX_LORA_RANK,
    Completion,
    Diagnostics,
    EngineConfig,
    GenerateRequest,
    LastReceive,
    PauseMode,
    ReceiveTimings,
    SamplingParams,
    StreamDelta,
)
from rollout_engines.weights.doorbell import Doorbell, has_store, new_door
from rollout_engines.weights.manifest import (
    TensorSpec,
    TransportSpec,
    WeightManifest,
    manifest_to_wire,
    validate_manifest,
)

from . import translate
from .lora import DEFAULT_TARGETS, REFUSED_TARGETS, LoadedLora, SglangLoras
from .plugin import ASYNC_RL_CAPABILITIES, DEFAULT_CAPABILITIES, INSTALL_HINT
from .runtime import SglangLoraRuntime, SglangRuntime, SglangStreamingRuntime

if TYPE_CHECKING:
    from rollout_engines.weights.fp8 import Fp8Forms

logger = logging.getLogger("rollout_engines.sglang")

#: Transports received by the host process and relayed to SGLang over CUDA IPC.
RELAY_TRANSPORTS = ("cuda_ipc", "nccl", "gloo", "shm", "inproc")
#: How often a request waiting on SGLang checks whether a worker process has failed.
FAILURE_POLL_S = 0.25
#: resume() after a ``keep`` pause first reads the last chunk of every sequence the pause ended
#: (SGLang delivers them as it returns from the pause), waiting at most this long.
KEPT_DRAIN_MAX_S = 2.0
#: How often a suspended sequence checks for resume, its abort, or the engine's end.
KEPT_POLL_S = 0.005
#: How often a call into SGLang looks whether an update handed over by the doorbell is loaded.
DOOR_NAP_S = 0.0005
T = TypeVar("T")


class SglangOptions(BaseModel):
    """``EngineConfig.options`` of the ``sglang`` backend. Unknown keys go to SGLang's
    ``ServerArgs`` unchanged (e.g. ``disable_cuda_graph=True``, ``attention_backend="fa3"``)."""

    model_config = ConfigDict(extra="allow")

    mem_fraction_static: float | None = Field(default=None, gt=0, le=1)
    gpu_ids: list[int | str] | None = Field(
        default=None, description="GPUs the engine's workers see (CUDA_VISIBLE_DEVICES while they start)."
    )
    ray_bundle: dict[str, Any] | None = Field(
        default=None, description="rollout_engines.envs.RayBundle of the actor hosting the engine (executor 'mp')."
    )
    enable_weights_cpu_backup: bool = Field(
        default=False, description="SGLang keeps a CPU copy of the weights over sleep (then they survive it)."
    )
    enable_deterministic_inference: bool = Field(
        default=False, description="Batch-invariant kernels; also makes per-request seeds take effect."
    )
    relay_device: str | None = Field(
        default=None, description="CUDA device of this process that relayed transports receive on."
    )
    log_level: str = "error"
    start_timeout_s: float = Field(
        default=600.0, gt=0, description="Seconds SGLang may take to start (load the model, compile kernels) "
        "before its processes are stopped and the start fails with EngineUnavailable.",
    )
    copy_plan: bool = Field(
        default=True,
        description="Relayed pushes: learn on the first push where each tensor lands and load later pushes "
        "by direct copies (rollout_engines.weights.copy_plan, through the plugin's SGLang custom weight loader) "
        "instead of SGLang's per-tensor loaders.",
    )
    forward_buckets: bool = Field(
        default=True,
        description="cuda_ipc pushes of the trainer's own GPU tensors: the relay forwards each bucket's description "
        "to the plugin's loader (copy_plan), which reads the trainer's memory itself (one copy per push instead of "
        "two), instead of staging it; where the loader cannot open that memory it stages as before. 0.92 of vLLM's "
        "push rate on one H100 (benchmarks/RESULTS.md); False: always stage.",
    )
    direct_receive: bool = Field(
        default=True,
        description="shm and cuda_ipc pushes with copy_plan and one TP rank: after the first update SGLang's "
        "scheduler process receives updates from the trainer itself, handed to it through a doorbell on the "
        "weight-sync store (a thread there; rollout_engines.weights.doorbell), instead of the relay and SGLang's "
        "update_weights_from_tensor (tokenizer manager, scheduler queue), while no request runs; requests that "
        "come meanwhile wait. Sets SGLang's sleep_on_idle unless passed (an idle scheduler that spins holds the "
        "GIL the doorbell's thread needs; with sleep_on_idle=False the doorbell is not used). "
        "info().extra['direct_receives'] counts its updates.",
    )
    weight_quantization: Literal["none", "fp8_block"] = Field(
        default="none",
        description="'fp8_block': serve an FP8 copy of the (BF16) checkpoint, e4m3 weights with 128x128 "
        "block scales, built once and cached (rollout_engines.weights.fp8); pushes carry BF16 (quantized "
        "by the host's relay before SGLang loads them; relayed transports only) or FP8 "
        "(WeightSync.push(quantize='fp8_block'); every transport). Named as the vLLM backend's option.",
    )
    enable_lora: bool = Field(default=False, description="Serve LoRA adapters (WeightSync.push_lora).")
    max_lora_rank: int = Field(default=16, ge=1, le=MAX_LORA_RANK, description="Largest adapter rank (SGLang's max_lora_rank).")
    max_loras: int = Field(
        default=2, ge=1, description="Adapters loaded at once (SGLang's max_loras_per_batch is 2 * max_loras + 1)."
    )
    lora_target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        description="Modules adapters may target (SGLang's lora_target_modules; its LoRA buffers are sized for them).",
    )

    @field_validator("lora_target_modules")
    @classmethod
    def _lora_targets(cls, v: list[str]) -> list[str]:
        refused = sorted(set(v) & set(REFUSED_TARGETS))
        if refused:
            raise ValueError(f"lora_target_modules cannot include {refused}: LoRA pushes carry linear layers only; "
                             "name them (e.g. q_proj, v_proj)")
        if not v:
            raise ValueError("lora_target_modules is empty; name the linear layers adapters may target")
        return v


#: SGLang arguments the engine sets itself (where it does), and where to set them instead.
_SET_HERE = {
    "model_path": "EngineConfig.model", "tokenizer_path": "EngineConfig.tokenizer", "dtype": "EngineConfig.dtype",
    "random_seed": "EngineConfig.seed", "tp_size": "EngineConfig.tensor_parallel_size",
    "enable_memory_saver": "nothing (sleep and wake-up need it)",
    "context_length": "EngineConfig.max_model_len", "base_gpu_id": "EngineConfig.device",
}


def _server_args() -> type | None:
    """SGLang's ``ServerArgs`` (what ``sglang.Engine`` takes), where SGLang is installed."""
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return None
    return ServerArgs


def server_kwargs(config: EngineConfig, opts: SglangOptions, model_path: str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` for ``config`` (pure; SGLang validates them).
    ``model_path``: the checkpoint SGLang loads when it is not ``config.model`` (the FP8 copy of
    option ``weight_quantization``; SGLang reads its ``quantization_config``)."""
    kw: dict[str, Any] = {
        "model_path": model_path or config.model,
        "tokenizer_path": config.tokenizer or config.model,
        "dtype": config.dtype,
        "random_seed": config.seed,
        "tp_size": config.tensor_parallel_size,
        # release/resume_memory_occupation (sleep/wake) need SGLang's memory saver.
        "enable_memory_saver": True,
        "log_level": opts.log_level,
    }
    if config.dtype == "float32" and not opts.enable_deterministic_inference:
        # Seen with SGLang 0.5.17 on an H200: the first request crashes the scheduler with
        # "rmsnorm ... failed to dispatch data type Float" (sgl_kernel's RMSNorm is half precision).
        raise CapabilityError(
            "backend 'sglang' cannot run dtype='float32' on CUDA: SGLang's RMSNorm kernel has no float32 "
            "path and its scheduler crashes on the first request. Use dtype='bfloat16' or 'float16', or "
            "enable_deterministic_inference=True (RMSNorm then runs through SGLang's Triton kernels, "
            "which are not limited to half precision)"
        )
    if config.max_model_len is not None:
        kw["context_length"] = config.max_model_len
    if config.device is not None:
        kind, _, index = config.device.partition(":")
        if kind != "cuda":
            raise ValueError(f"SGLang runs on CUDA devices, not '{config.device}'; use device='cuda' or 'cuda:N'")
        if index:
            kw["base_gpu_id"] = int(index)
    if opts.mem_fraction_static is not None:
        kw["mem_fraction_static"] = opts.mem_fraction_static
    if opts.enable_weights_cpu_backup:
        kw["enable_weights_cpu_backup"] = True
    if opts.enable_deterministic_inference:
        kw["enable_deterministic_inference"] = True
    if opts.enable_lora:
        # Adapters are loaded after the start, so SGLang needs the rank and the modules up front
        # (check_lora_server_args). Batch slots: every adapter, the retiring version of each (its
        # requests finish while new ones run on the next), and the base model, which takes one.
        kw.update(enable_lora=True, max_lora_rank=opts.max_lora_rank,
                  lora_target_modules=list(opts.lora_target_modules), max_loras_per_batch=2 * opts.max_loras + 1)
        clash = sorted({"lora_paths", "max_loaded_loras"} & set(opts.model_extra or {}))
        if clash:
            # Adapters of lora_paths are not pushed versions; max_loaded_loras makes SGLang evict
            # adapters and reload them from their path, which a tensor-loaded adapter does not have.
            raise ValueError(f"backend 'sglang' with enable_lora manages its adapters itself; drop {clash}")
    extra = opts.model_extra or {}
    check_passed_options(extra, _server_args(), library="sglang ServerArgs", own=SglangOptions.model_fields,
                         set_here={key: _SET_HERE[key] for key in kw if key in _SET_HERE})
    kw.update(extra)
    if opts.direct_receive and opts.copy_plan and "sleep_on_idle" not in extra:
        # Between requests SGLang's scheduler loops in Python unless it sleeps on its sockets; the
        # doorbell's thread in that process would wait for the GIL on every step of a load.
        kw["sleep_on_idle"] = True
    if opts.copy_plan:
        from .loader import LOADER

        loaders = list(kw.get("custom_weight_loader") or [])
        kw["custom_weight_loader"] = loaders if LOADER in loaders else [*loaders, LOADER]
    return kw


def capabilities_for(opts: SglangOptions, streaming_runtime: bool = True, lora_runtime: bool = True) -> Capabilities:
    """``streaming_runtime``: whether the runtime streams, aborts and pauses in SGLang's modes
    (:class:`~.runtime.SglangStreamingRuntime`); without, the async-RL capabilities are off.
    ``lora_runtime``: whether it loads adapters from tensors (:class:`~.runtime.SglangLoraRuntime`);
    ``lora`` and ``max_loras`` are declared only with it and ``enable_lora``."""
    caps = dict(DEFAULT_CAPABILITIES)
    caps["seed"] = opts.enable_deterministic_inference
    caps["weights_kept_on_sleep"] = opts.enable_weights_cpu_backup
    if not streaming_runtime:
        for key in ASYNC_RL_CAPABILITIES:
            caps.pop(key, None)
    if opts.enable_lora and lora_runtime:
        caps.update(lora=opts.max_lora_rank, max_loras=opts.max_loras)
    return Capabilities(**caps)


@dataclass
class _Seq:
    """One prompt x sample of a request, as SGLang runs it (rid = its request id)."""

    rid: str
    prompt_index: int
    sample_index: int
    out: translate.SequenceOutput
    final_sent: bool = False
    cut: int | None = None  # where a stop token ends it (ignore_eos + stop_token_ids)
    #: The rid of its current SGLang request (the request id, then a new one per resubmission).
    sglang_rid: str = ""
    #: Ended by a ``keep`` pause (SGLang aborted it): goes on as a new SGLang request on resume.
    suspended: bool = False
    resubmissions: int = 0


@dataclass
class _Plan:
    request: GenerateRequest
    prompts: list[list[int]]
    seqs: list[_Seq]
    kwargs: dict[str, Any] = field(default_factory=dict)
    lora: LoadedLora | None = None  # the adapter version it runs on, held until it ends


def _sglang_missing() -> str | None:
    try:
        found = importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "no module named 'sglang'"


class SglangEngine(Engine):
    """An SGLang engine in this process (its TP workers in subprocesses SGLang starts)."""

    backend_name: ClassVar[str] = "sglang"
    #: Updates are applied in SGLang's scheduler, between two steps: generation stops meanwhile.
    updates_hold_generation: ClassVar[bool] = True
    capabilities = Capabilities(**DEFAULT_CAPABILITIES)

    def __init__(self, config: EngineConfig, *, runtime: SglangRuntime | None = None) -> None:
        """``runtime``: an already started SGLang runtime (tests pass a double); by default
        SGLang's in-process engine is started here."""
        super().__init__(config)
        self.options = SglangOptions.model_validate(config.options)
        self.capabilities = capabilities_for(self.options)
        self._failed: str | None = None
        self._unguard: Callable[[], None] | None = None
        self._expected: dict[str, TensorSpec] | None = None
        self._forms: Fp8Forms | None = None
        self._transfer: _Transfer | None = None
        # Requests submitted, and their count at the last prefix-cache flush: a push with nothing
        # generated since then has nothing cached to flush (SGLang's flush also empties torch's
        # allocator cache; it is skipped, as in the vLLM plugin).
        self._cache = PrefixCacheTracker()
        self.runtime: SglangRuntime = runtime if runtime is not None else self._start_runtime()
        self._streaming = isinstance(self.runtime, SglangStreamingRuntime)
        self.capabilities = capabilities_for(
            self.options, self._streaming, isinstance(self.runtime, SglangLoraRuntime)
        )
        self._loras: SglangLoras | None = None
        if self.capabilities.lora:
            self._loras = SglangLoras(self, self.options.lora_target_modules)
        #: rid -> sequence, of every request running through SGLang's stream.
        self._live: dict[str, _Seq] = {}
        self._abort_tasks: set[asyncio.Task[None]] = set()
        #: While paused in ``keep``: the version of the tokens SGLang made before the pause (read
        #: until resume, see _resume).
        self._kept_version: int | None = None
        #: True while a ``keep`` pause holds suspended sequences; a suspended sequence waits (polls:
        #: callers may come from different event loops) until it is False or it was aborted.
        self._keep_active = False
        #: The sequences in flight when the ``keep`` pause began.
        self._kept: list[_Seq] = []
        #: rids the caller aborted (a keep pause's abort of them is final, not a suspension).
        self._user_aborted: set[str] = set()

    # ---- start ---------------------------------------------------------------------------------
    def _start_runtime(self) -> SglangRuntime:
        missing = _sglang_missing()
        if missing:
            raise BackendNotInstalled("sglang", INSTALL_HINT, cause=missing)
        from rollout_engines.envs import launch_env, setup_device_env

        from .runtime import InProcessRuntime
        from .signals import guard_child_failure_signal

        ray_bundle = self.options.ray_bundle
        if ray_bundle is not None and ray_bundle.get("executor", "ray") == "ray":
            raise ValueError(
                "SGLang starts its own worker processes: pass ray_bundle with executor='mp' and "
                "gpu_ids=ray.get_gpu_ids()"
            )
        changes = setup_device_env(
            "sglang", gpu_ids=self.options.gpu_ids, ray_bundle=ray_bundle, apply=False
        )
        kwargs = server_kwargs(self.config, self.options, self._served_model())
        self._unguard = guard_child_failure_signal(self._on_worker_failure)
        try:
            with launch_env(changes):
                return InProcessRuntime(kwargs, start_timeout_s=self.options.start_timeout_s)
        except BaseException:
            self._unguard()
            raise

    def _on_worker_failure(self) -> None:
        self._failed = "an SGLang worker process failed (see its log); create a new engine"

    # ---- generation ----------------------------------------------------------------------------
    def _check_request(self, request: GenerateRequest) -> None:
        super()._check_request(request)
        if request.sampling.seed is not None and not self.capabilities.seed:
            raise CapabilityError(
                "backend 'sglang' ignores per-request seeds unless the engine runs with "
                "enable_deterministic_inference=True; create it so, or drop sampling.seed"
            )

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        if self._failed:
            raise EngineUnavailable(self._failed)
        if self._streaming:
            return await self._generate_streamed(request)
        version = self.weight_version
        prompts = translate.tokenize_request(request, self.runtime.tokenizer)
        validate_prompts(
            prompts,
            max_tokens=request.sampling.max_tokens,
            max_model_len=self.config.max_model_len or self.runtime.context_length,
            vocab_size=self.runtime.vocab_size,
        )
        lora = self._acquire_lora(request)
        try:
            self._cache.submitted()
            kwargs = translate.generate_kwargs(request, prompts, lora_path=lora.sglang_name if lora else None)
            outputs = await self._unless_failed(self.runtime.generate(**kwargs))
        finally:
            self._release_lora(lora)
        tokenizer = self.runtime.tokenizer
        return _tag(translate.to_completions(
            outputs, prompts, request.sampling, version,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        ), lora)

    def _acquire_lora(self, request: GenerateRequest) -> LoadedLora | None:
        """The adapter version ``request`` runs on (the current one of ``request.lora``), held for
        it: a LoRA push meanwhile retires it but SGLang keeps it until released."""
        if request.lora is None:
            return None
        if self._loras is None:  # the core refuses this already (capability 'lora')
            raise CapabilityError("backend 'sglang' serves LoRA adapters only with enable_lora=True")
        return self._loras.acquire(request.lora)

    def _release_lora(self, lora: LoadedLora | None) -> None:
        if lora is not None and self._loras is not None:
            self._loras.release(lora)

    def _plan(self, request: GenerateRequest) -> _Plan:
        """Tokenize and check ``request``; one :class:`_Seq` per prompt x sample."""
        prompts = translate.tokenize_request(request, self.runtime.tokenizer)
        priors = request.continue_from
        validate_prompts(
            prompts,
            max_tokens=request.sampling.max_tokens,
            max_model_len=self.config.max_model_len or self.runtime.context_length,
            vocab_size=self.runtime.vocab_size,
            continued=[c.token_ids for c in priors] if priors is not None else None,
        )
        check_continuations(request)
        rids = request.sequence_ids()
        dup = [r for r in rids if r in self._live]
        if dup:
            raise InvalidRequest(f"request id '{dup[0]}' is already running on this engine; ids must be unique")
        n = request.sampling.n
        incremental = bool(getattr(self.runtime, "incremental_stream", False))
        seqs = [_Seq(rid, k // n, k % n, translate.SequenceOutput(incremental)) for k, rid in enumerate(rids)]
        lora = self._acquire_lora(request)  # released by the caller once the request ends
        try:
            kwargs = translate.generate_kwargs(request, prompts, rids, lora.sglang_name if lora else None)
        except BaseException:
            self._release_lora(lora)
            raise
        return _Plan(request, prompts, seqs, kwargs, lora)

    async def _run(self, plan: _Plan) -> AsyncGenerator[tuple[_Seq, int, int], None]:
        """Drive SGLang's stream for ``plan``: yields (sequence, start, end) of the tokens each
        chunk added. Sequences a ``keep`` pause suspended go on after resume as new SGLang
        requests (see :meth:`_pause`). Sequences still running when this ends (the caller
        stopped, an error) are aborted in SGLang."""
        runtime = self.runtime
        assert isinstance(runtime, SglangStreamingRuntime)
        for q in plan.seqs:
            q.sglang_rid = q.rid
        self._live.update({q.rid: q for q in plan.seqs})
        kwargs, batch = plan.kwargs, list(plan.seqs)
        place = {q.rid: k for k, q in enumerate(plan.seqs)}  # a sequence's place in plan.kwargs
        try:
            while True:
                once = self._run_once(runtime, kwargs, batch, plan.request.sampling)
                try:
                    async for item in once:
                        yield item
                finally:
                    await once.aclose()  # aborts in SGLang what still runs (the caller stopped)
                suspended = [q for q in batch if q.suspended]
                if not suspended:
                    return
                await self._wait_until_resumed(suspended)
                for q in suspended:
                    if q.out.finished:  # aborted while suspended: its last delta, no new tokens
                        q.suspended = False
                        n = len(q.out.token_ids)
                        yield q, n, n
                batch = [q for q in suspended if not q.out.finished]
                if not batch:
                    return
                picks = []
                for q in batch:
                    q.suspended, q.resubmissions = False, q.resubmissions + 1
                    q.sglang_rid = f"{q.rid}~{q.resubmissions}"
                    q.out.resubmitted(self._decode)
                    picks.append((place[q.rid], list(q.out.token_ids), q.sglang_rid))
                kwargs = translate.continuation_kwargs(plan.kwargs, picks)
        finally:
            for q in plan.seqs:
                self._live.pop(q.rid, None)
                self._user_aborted.discard(q.rid)

    async def _run_once(self, runtime: SglangStreamingRuntime, kwargs: dict[str, Any],
                        batch: list[_Seq], sampling: SamplingParams) -> AsyncGenerator[tuple[_Seq, int, int], None]:
        """One SGLang call for the sequences in ``batch`` (in its order). A sequence the ``keep``
        pause aborted is suspended, unless its last token already ended it
        (:func:`.translate.ended_before_abort`): then it ends with that reason."""
        by_rid = {q.sglang_rid: q for q in batch}
        self._cache.submitted()
        chunks: AsyncIterator[dict[str, Any]] = runtime.generate_stream(**kwargs)
        try:
            while True:
                try:
                    chunk = await self._unless_failed(chunks.__anext__())
                except StopAsyncIteration:
                    break
                meta = chunk.get("meta_info") or {}
                q = by_rid.get(str(meta.get("id", "")))
                if q is None:  # a single request's chunk carries no index (tokenizer_manager.py)
                    q = batch[int(chunk.get("index", 0))]
                version = self.weight_version if self._kept_version is None else self._kept_version
                start, end = q.out.absorb(chunk, version)
                if (q.out.finished and self._kept_version is not None and q.rid not in self._user_aborted
                        and translate.finish_reason({"finish_reason": q.out.finish}) == "abort"):
                    done = translate.ended_before_abort(q.out.token_ids, sampling, self._eos_token_ids(), self._decode)
                    if done is not None:
                        q.out.end(done, self._decode)
                    else:
                        q.out.finished, q.out.finish, q.suspended = False, None, True
                yield q, start, end
        finally:
            open_rids = [q.sglang_rid for q in batch if not q.out.finished and not q.suspended]
            if open_rids and not self._failed:
                try:
                    for rid in open_rids:
                        await runtime.abort(rid)
                except Exception:  # best effort: SGLang may be shutting down
                    logger.debug("aborting abandoned SGLang requests failed", exc_info=True)
            try:
                await chunks.aclose()  # type: ignore[attr-defined]
            except RuntimeError:  # still running: a step given up on a failed worker
                pass

    async def _wait_until_resumed(self, suspended: list[_Seq]) -> None:
        """Until the ``keep`` pause ends (resume), every suspended sequence was aborted, or the
        engine failed or closed (then they end as aborted)."""
        while self._keep_active:
            if all(q.out.finished for q in suspended):
                return
            if self._failed or self.closed:
                break
            await asyncio.sleep(KEPT_POLL_S)
        if self._failed or self.closed:
            for q in suspended:
                if not q.out.finished:
                    q.out.finished, q.out.finish = True, {"type": "abort", "message": "engine closed while paused"}

    def _eos_token_ids(self) -> list[int]:
        """The ids SGLang ends a sequence at unless ``ignore_eos``: the model's EOS ids (SGLang's
        ``ModelConfig.hf_eos_token_id``, where the runtime has them) and the tokenizer's."""
        ids = getattr(self.runtime, "eos_token_ids", None)
        if isinstance(ids, int):
            ids = [ids]
        out = {int(t) for t in ids or ()}
        eos = getattr(self.runtime.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            out.add(eos)
        return sorted(out)

    def _decode(self, ids: list[int]) -> str:
        return str(self.runtime.tokenizer.decode(ids, skip_special_tokens=True))

    async def _generate_streamed(self, request: GenerateRequest) -> list[Completion]:
        version = self.weight_version
        plan = self._plan(request)
        try:
            async for _ in self._run(plan):
                pass
        finally:
            self._release_lora(plan.lora)
        s = request.sampling
        outputs = [q.out.as_output() for q in plan.seqs]
        comps = translate.to_completions(outputs, plan.prompts, s, version, decode=self._decode)
        priors = request.continue_from
        return _tag([
            translate.complete(c, q.out, s, len(plan.prompts[q.prompt_index]),
                               priors[q.prompt_index] if priors is not None else None, q.rid)
            for c, q in zip(comps, plan.seqs, strict=True)
        ], plan.lora)

    async def _stream(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        if not self._streaming:
            async for d in super()._stream(request):
                yield d
            return
        if self._failed:
            raise EngineUnavailable(self._failed)
        plan = self._plan(request)
        s = request.sampling
        cut_stops = s.stop_token_ids if s.ignore_eos else []
        run = self._run(plan)
        try:
            async for q, start, end in run:
                if q.final_sent:
                    continue
                reason = translate.finish_reason({"finish_reason": q.out.finish}) if q.out.finished else None
                if cut_stops:
                    # As generate(): the first stop token ends the sequence (SGLang, told to ignore
                    # EOS, does not stop on it); SGLang's request is aborted.
                    cut = translate.cut_at_stop_token(q.out.token_ids[start:end], cut_stops)
                    if cut is not None:
                        end, reason = start + cut, "stop"
                        if not q.out.finished:
                            await self._abort_rids([q.rid])
                if start == end and reason is None:
                    continue
                yield StreamDelta(
                    request_id=q.rid, prompt_index=q.prompt_index, sample_index=q.sample_index,
                    token_ids=q.out.token_ids[start:end],
                    logprobs=(translate.logprob_values(q.out.logprob_entries[start:end])
                              if s.logprobs is not None else None),
                    top_logprobs=(translate.top_lists(q.out, start, end, s.top_logprobs)
                                  if s.top_logprobs is not None else None),
                    weight_version=q.out.versions[end - 1] if end > start else self.weight_version,
                    finish_reason=reason,
                    lora=plan.lora.name if plan.lora else None,
                    lora_version=plan.lora.version if plan.lora else None,
                )
                if reason is not None:
                    q.final_sent = True
        finally:
            try:
                await run.aclose()
            finally:
                self._release_lora(plan.lora)

    async def _abort(self, request_ids: Sequence[str] | None) -> None:
        if not self._streaming:
            await super()._abort(request_ids)
            return
        if request_ids is None:
            assert isinstance(self.runtime, SglangStreamingRuntime)
            await self.runtime.abort(None)
            rids = list(self._live)
        else:
            rids = [r for r in dict.fromkeys(request_ids) if r in self._live]
        await self._abort_rids(rids)

    async def _abort_rids(self, rids: list[str]) -> None:
        """SGLang's abort of each rid, repeated until each has ended: an abort that reaches SGLang
        before the request is registered in its tokenizer manager is ignored there."""
        seqs = [self._live[r] for r in rids if r in self._live]
        if not seqs:
            return
        runtime = self.runtime
        assert isinstance(runtime, SglangStreamingRuntime)
        self._user_aborted.update(q.rid for q in seqs)
        for q in seqs:
            if q.suspended:  # not in SGLang now: ends here, with its tokens so far
                q.out.finished, q.out.finish = True, {"type": "abort", "message": "aborted while paused"}
            else:
                await runtime.abort(q.sglang_rid)

        async def again() -> None:
            delay = 0.02
            while True:
                await asyncio.sleep(delay)
                delay = min(0.25, delay * 2)
                live = [q for q in seqs if not q.out.finished and not q.suspended and q.rid in self._live]
                if not live or self._failed or self.closed:
                    return
                for q in live:
                    await runtime.abort(q.sglang_rid)

        task = asyncio.ensure_future(again())
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)

    async def _unless_failed(self, call: Awaitable[T]) -> T:
        """Await ``call``, but give up with :class:`EngineUnavailable` once a worker process has
        failed: SGLang never answers requests that were in flight on a dead scheduler. Nothing
        goes to SGLang while the doorbell hands it an update (:meth:`_claim_door`)."""
        await self._door_idle()
        task = asyncio.ensure_future(call)
        while True:
            done, _ = await asyncio.wait({task}, timeout=FAILURE_POLL_S)
            if done:
                return task.result()
            if self._failed:
                task.cancel()
                raise EngineUnavailable(self._failed)

    def _door(self) -> Doorbell | None:
        t = self._transfer
        target = t.receiver.target if t is not None and t.receiver is not None else None
        return target.door if isinstance(target, _RelayTarget) else None

    async def _door_idle(self) -> None:
        """Wait while the doorbell hands SGLang an update (bounded by the update's timeout: the
        ring ends on the relay's thread either way)."""
        door = self._door()
        while door is not None and door.busy:
            await asyncio.sleep(DOOR_NAP_S)

    def _claim_door(self, target: _RelayTarget) -> bool:
        """Claim the relay's doorbell for one update if nothing runs in SGLang. The claim is made
        first and the requests counted after: a request counts itself before it looks at the
        doorbell (:meth:`_unless_failed`), so one of the two sees the other."""
        door = target.door
        if door is None or not door.claim():  # a door exists only with option direct_receive
            return False
        if self._outstanding or self._live:
            door.release()
            return False
        return True

    # ---- memory and scheduling ------------------------------------------------------------------
    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        self._cache.forget()  # memory released and restored: always flush afterwards
        # The relay's staging buffer (a bucket's size, in this process) goes too: a colocated
        # trainer sleeps the engine to have the memory.
        await self._release_staging(self._transfer)
        await self.runtime.release_memory(list(tags))

    async def _wake_up(self, tags: Sequence[str]) -> None:
        self._cache.forget()
        await self.runtime.resume_memory(list(tags))

    async def _reset_prefix_cache(self) -> None:
        submitted = self._cache.dirty()
        if submitted is None:
            return  # nothing generated since the last flush: nothing cached
        # SGLang refuses to flush while requests run (e.g. paused in place): retry briefly, as a
        # push or wake-up that just finished may race with requests still draining.
        for attempt in range(20):
            try:
                await self.runtime.flush_cache()
                self._cache.reset_done(submitted)
                return
            except Exception as exc:
                if attempt == 19:
                    raise EngineUnavailable(f"SGLang did not flush its prefix cache: {exc}") from exc
                await asyncio.sleep(0.25)

    async def _pause(self, mode: PauseMode) -> None:
        """See the module docstring: ``wait`` drains and then pauses SGLang ``in_place`` (nothing
        runs then; after a ``keep`` pause, its suspended sequences run to their end first),
        ``abort`` is SGLang's mode ``abort``, ``keep`` its mode ``retract``."""
        runtime = self.runtime
        if mode == "keep":
            assert isinstance(runtime, SglangStreamingRuntime)
            self._kept_version = self.weight_version
            self._kept = [q for q in self._live.values() if not q.out.finished]
            self._keep_active = True
            try:
                await runtime.pause_mode("abort")
            except BaseException:
                self._kept_version = None
                self._keep_active = False
                raise
            return
        if mode == "wait" and self._keep_active:
            # The sequences a keep pause suspended could never drain: they are resubmitted and run
            # to their end (the base class still holds new requests), then SGLang pauses in place.
            await self._resume()
        if mode == "abort":
            assert isinstance(runtime, SglangStreamingRuntime)
            await runtime.pause_mode("abort")
            # Sequences a keep pause suspended are not in SGLang: they end here, as aborted.
            await self._abort_rids([rid for rid, q in self._live.items() if q.suspended])
        while self._outstanding:
            if self._failed:
                raise EngineUnavailable(self._failed)
            await asyncio.sleep(0.005)
        if mode == "wait":
            await runtime.pause()

    async def _resume(self) -> None:
        if self._kept_version is not None:
            # Read what SGLang made before the pause under the old version: every sequence that
            # ran then has its last chunk (the abort) read once it is suspended or finished.
            # Bounded: SGLang returned from its pause once no request ran.
            deadline = time.monotonic() + KEPT_DRAIN_MAX_S
            while time.monotonic() < deadline and any(
                not (q.out.finished or q.suspended) for q in self._kept if q.rid in self._live
            ):
                await asyncio.sleep(0.002)
            self._kept_version, self._kept = None, []
        await self.runtime.resume()
        self._keep_active = False

    # ---- weights -------------------------------------------------------------------------------
    def weight_receivers(self) -> int:
        return 1

    def _served_model(self) -> str:
        """The checkpoint SGLang loads: the model, or its FP8 block copy (``weight_quantization``)."""
        from rollout_engines.weights.fp8 import served_checkpoint

        return served_checkpoint(self.config.model, self.options.weight_quantization)

    def _runtime_dtype(self) -> str | None:
        return None if self.config.dtype == "auto" else self.config.dtype

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        """What an update may carry: the checkpoint's tensors, in the engine's dtype (an FP8 engine:
        those of the BF16 form, see :meth:`_specs_for`)."""
        if self._expected is None:
            forms = self._fp8_forms()
            if forms is not None:
                self._expected = forms.bf16
            else:
                from .checkpoint import checkpoint_specs

                self._expected = checkpoint_specs(self.config.model, self._runtime_dtype())
        return self._expected

    def _fp8_forms(self) -> Fp8Forms | None:
        """The two forms a push into an FP8 engine may take (None for a BF16 engine)."""
        if self.options.weight_quantization == "none":
            return None
        if self._forms is None:
            from rollout_engines.weights.fp8 import Fp8Forms

            from .checkpoint import checkpoint_specs

            # dtype 'auto': the BF16 checkpoint's own float dtype, as the BF16 engine expects.
            dtype = self._runtime_dtype() or next(
                (sp.dtype for sp in checkpoint_specs(self.config.model).values()
                 if sp.dtype in ("bfloat16", "float16", "float32")), "bfloat16")
            self._forms = Fp8Forms.of_checkpoint(self._served_model(), dtype)
        return self._forms

    def _specs_for(self, manifest: WeightManifest, *, relayed: bool) -> Mapping[str, TensorSpec]:
        """What ``manifest`` is checked against. An FP8 engine takes the FP8 form (weights with their
        scales) on every transport, and the BF16 form where the relay quantizes it (``relayed``);
        raises ManifestMismatch for what it cannot take, before anything is applied."""
        forms = self._fp8_forms()
        if forms is None:
            return self.expected_specs()
        names = [t.name for t in manifest.tensors]
        problems = forms.problems(names)
        if problems:
            raise ManifestMismatch(
                f"weight update v{manifest.version} rejected before applying anything: " + "; ".join(problems[:5])
                + ". An FP8 push sends every quantized weight with its block scales"
            )
        specs = forms.specs_for(names)
        if specs is forms.bf16 and not relayed:
            raise ManifestMismatch(
                f"weight update v{manifest.version} rejected: this engine serves an FP8 block copy and SGLang "
                f"loads a '{self._transfer.spec.transport if self._transfer else '?'}' push as sent, so BF16 "
                "weights cannot be quantized on the way. Push with WeightSync.push(..., quantize='fp8_block'), "
                "or over a relayed transport (" + ", ".join(RELAY_TRANSPORTS) + "), where the engine quantizes"
            )
        return specs

    def _invalidate(self, reason: str) -> None:
        """Mark the weights unusable: generation raises WeightsInvalidated until a complete push."""
        self._weights_invalid = reason

    def _relay_device(self) -> str:
        if self.options.relay_device:
            return self.options.relay_device
        if self.options.gpu_ids and "CUDA_VISIBLE_DEVICES" not in os.environ:
            return f"cuda:{self.options.gpu_ids[0]}"
        return self.config.device if self.config.device and ":" in self.config.device else "cuda:0"

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        await self._close_weight_transfer()
        if spec.transport == "sglang_nccl":
            from .transport import SglangNcclControl

            control = await asyncio.to_thread(SglangNcclControl, spec)
            real, world = await asyncio.to_thread(control.register, self.runtime.tp_size)
            # Blocks until the trainer and every engine joined (the trainer joins concurrently).
            await self.runtime.init_weights_group(control.host, control.group_port, real, world, control.group_name)
            self._transfer = _Transfer(spec, control=control)
            return
        from rollout_engines.weights.receiver import WeightReceiver

        if spec.transport == "disk":
            receiver = WeightReceiver(_VerifyOnly(self.expected_specs()), device="cpu", mode="inplace", label="sglang")
        else:
            target = _RelayTarget(self, self._relay_device(), spec)
            receiver = WeightReceiver(target, device=target.device, mode="inplace", label="sglang")
        await asyncio.to_thread(receiver.connect, spec)
        self._transfer = _Transfer(spec, receiver=receiver)

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        t = self._transfer
        if t is None:
            raise WeightSyncError("sglang: no weight transfer initialised; connect_weight_sync() first")
        if t.spec.transport == "sglang_nccl":
            await self._receive_distributed(t, manifest)
        elif t.spec.transport == "disk":
            await self._receive_disk(t, manifest)
        else:
            await self._receive_relay(t, manifest)

    async def _receive_distributed(self, t: _Transfer, manifest: WeightManifest) -> None:
        from .payloads import aligned_chunks, distributed_args

        control = t.control
        assert control is not None
        reason = None
        try:
            validate_manifest(manifest, self._specs_for(manifest, relayed=False))
        except ManifestMismatch as exc:
            reason = str(exc)
        await asyncio.to_thread(control.verdict, manifest, reason)
        if reason is not None:
            raise ManifestMismatch(reason)
        applied = False
        try:
            for bucket in manifest.buckets:
                await asyncio.to_thread(control.wait_go, manifest, bucket.index)
                for chunk in aligned_chunks(manifest.bucket_tensors(bucket.index)):
                    applied = True
                    await self.runtime.update_from_distributed(
                        **distributed_args(chunk), group_name=control.group_name
                    )
        except BaseException as exc:
            if applied:
                self._invalidate(f"update v{manifest.version} failed after part of it was applied ({exc})")
                raise WeightsInvalidated(
                    f"sglang: update v{manifest.version} failed after part of it was applied: {exc}; "
                    "generation is refused until a complete push"
                ) from exc
            raise

    async def _receive_disk(self, t: _Transfer, manifest: WeightManifest) -> None:
        from rollout_engines.weights.transports.disk import update_dir

        assert t.receiver is not None
        await self._select_specs(t, manifest, relayed=False)
        try:
            # Validation, every bucket file and its checksum, before SGLang reads a byte.
            await asyncio.to_thread(t.receiver.receive, manifest)
        except WeightsInvalidated as exc:  # nothing reached SGLang yet: the weights are intact
            raise WeightSyncError(str(exc).replace("after some weights were applied", "while checking the files")) from exc
        path = update_dir(t.spec.options["path"], manifest)
        try:
            await self.runtime.update_from_disk(str(path))
        except BaseException as exc:
            # SGLang's own rollback re-reads the same directory, so the state is unknown.
            self._invalidate(f"loading update v{manifest.version} from {path} failed ({exc})")
            raise WeightsInvalidated(
                f"sglang: loading update v{manifest.version} from disk failed: {exc}; "
                "generation is refused until a complete push"
            ) from exc

    async def _receive_relay(self, t: _Transfer, manifest: WeightManifest) -> None:
        receiver = t.receiver
        assert receiver is not None
        target = receiver.target
        assert isinstance(target, _RelayTarget)
        target.loop, target.timeout_s = asyncio.get_running_loop(), t.spec.timeout_s
        await self._select_specs(t, manifest, relayed=True)
        if target.takes_direct(manifest, self._quantizes(target.specs)) and self._claim_door(target):
            await self._receive_direct(receiver, target, manifest)
            return
        try:
            await asyncio.to_thread(receiver.receive, manifest)
        except WeightsInvalidated as exc:
            self._invalidate(str(exc))
            raise
        # The host's receiver: 'apply' is staging (or forwarding) plus SGLang's update_weights_from_tensor.
        self._last_receive = LastReceive(version=manifest.version, workers=[ReceiveTimings.of(receiver.last_timings)])
        if not target.door_tried:  # once per weight transfer, off the loop (SGLang's call, store joins)
            await asyncio.to_thread(target.start_door)
            if target.door is not None:  # later updates skip the relay: its staging buffer goes
                await target.release()

    async def _receive_direct(self, receiver: Any, target: _RelayTarget, manifest: WeightManifest) -> None:
        """Hand ``manifest`` to SGLang's scheduler through the doorbell (claimed by the caller): it
        receives the update from the trainer itself (:mod:`.loader`)."""
        door = target.door
        assert door is not None

        def check() -> None:
            if self._failed:
                raise EngineUnavailable(self._failed)

        wire = manifest_to_wire(manifest)
        wire["sent"] = time.time()
        start = time.perf_counter()
        # Released once the scheduler answered, also if this call is cancelled meanwhile.
        answers = await door.ring(wire, timeout_s=manifest.timeout_s * (len(manifest.buckets) + 2), check=check)
        back, ring_s = time.time(), time.perf_counter() - start
        answer = answers[0] if answers and isinstance(answers[0], dict) else {}
        self._last_receive = LastReceive(version=manifest.version, rpc_s=round(ring_s, 6), direct=True,
                                         workers=[ReceiveTimings.of(answer.get("timings"))])
        # The relay's receiver did not take this update: its record follows the scheduler's.
        receiver.delta_base = None
        try:
            raise_for_workers(answers, f"weight update v{manifest.version}", applies_weights=True,
                              worker="SGLang scheduler")
        except WeightsInvalidated as exc:
            self._invalidate(str(exc))
            raise
        receiver.version = manifest.version
        target.rang(ring_s, answer, back)

    async def _select_specs(self, t: _Transfer, manifest: WeightManifest, *, relayed: bool) -> None:
        """Set what the receiver's target checks ``manifest`` against; a push the engine cannot take
        is drained (the session stays in step) and refused with nothing applied."""
        assert t.receiver is not None
        target = t.receiver.target
        try:
            target.specs = self._specs_for(manifest, relayed=relayed)
        except ManifestMismatch as exc:
            target.specs = self.expected_specs()
            # Drains the stream, so the session stays in step, and raises exc.
            await asyncio.to_thread(t.receiver.receive_side, manifest, target, rejection=exc)
            raise

    def _quantizes(self, specs: Mapping[str, TensorSpec]) -> bool:
        """Whether a push checked against ``specs`` is the BF16 form sent to an FP8 engine, which the
        relay quantizes before SGLang loads it."""
        return self._forms is not None and specs is self._forms.bf16

    @staticmethod
    async def _release_staging(t: _Transfer | None, *, shared: bool = False) -> None:
        if t is not None and t.receiver is not None and isinstance(t.receiver.target, _RelayTarget):
            await t.receiver.target.release(shared=shared)

    async def _receive_lora(self, manifest: WeightManifest) -> None:
        """Receive an adapter through the weight transfer and load it into SGLang (:mod:`.lora`)."""
        assert self._loras is not None  # the core checked capability 'lora'
        await self._loras.receive(manifest, self._transfer)

    async def _unload_lora(self, name: str) -> None:
        assert self._loras is not None
        await self._loras.unload(name)

    async def _close_weight_transfer(self) -> None:
        t, self._transfer = self._transfer, None
        if t is None:
            return
        if t.control is not None:
            try:
                await self.runtime.destroy_weights_group(t.control.group_name)
            except Exception:  # the group may be gone with a failed trainer
                logger.debug("destroy_weights_update_group failed", exc_info=True)
        if t.receiver is not None:
            await self._release_staging(t, shared=True)
            await asyncio.to_thread(t.receiver.close)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def health(self) -> bool:
        return not self._closed and self._failed is None

    async def _diagnostics(self, fingerprint: bool) -> Diagnostics:
        """Adds the platform and, asked for, SGLang's own weights checksum as the fingerprint
        (``check_weights(action="checksum")``: a hash of every parameter of every TP rank, FP8
        weights dequantized with their scales; it reads all the weights, so it costs a pass over
        them). None where the runtime has no checksum."""
        base = await super()._diagnostics(fingerprint)
        update: dict[str, Any] = {"platform": "cuda"}
        checksum = getattr(self.runtime, "weights_checksum", None)
        if fingerprint and checksum is not None:
            update["weights_fingerprint"] = await self._unless_failed(checksum())
        return base.model_copy(update=update)

    def _extra_info(self) -> dict[str, Any]:
        t = self._transfer
        relay = t.receiver.target if t is not None and t.receiver is not None else None
        return {
            "tp_size": self.runtime.tp_size,
            "failed": self._failed,
            "transport": t.spec.transport if t else None,
            # How the relay handed buckets to SGLang (this weight transfer): forwarded to the
            # loader (cuda_ipc, the trainer's tensors) or staged in its buffer.
            "relay_forwarded_buckets": relay.forwarded if isinstance(relay, _RelayTarget) else None,
            "relay_staging_bytes": relay.staging_bytes if isinstance(relay, _RelayTarget) else None,
            # Updates whose forwarded buckets went through the doorbell (option direct_receive).
            "direct_receives": relay.direct_receives if isinstance(relay, _RelayTarget) else None,
            **(relay.ring_medians_ms() if isinstance(relay, _RelayTarget) else {}),
        }

    async def _close(self) -> None:
        if self._loras is not None:
            self._loras.close()  # SGLang's shutdown frees the adapters
        try:
            await self._close_weight_transfer()
        finally:
            try:
                await asyncio.to_thread(self.runtime.shutdown)
            finally:
                if self._unguard is not None:
                    self._unguard()


def _tag(completions: list[Completion], lora: LoadedLora | None) -> list[Completion]:
    """``completions`` with the adapter version that produced them."""
    if lora is not None:
        for c in completions:
            c.lora, c.lora_version = lora.name, lora.version
    return completions


class _Transfer:
    def __init__(self, spec: TransportSpec, *, control: Any = None, receiver: Any = None) -> None:
        self.spec, self.control, self.receiver = spec, control, receiver


class _VerifyOnly:
    """A WeightTarget that checks and drops: for ``disk``, where SGLang reads the files itself."""

    def __init__(self, specs: Mapping[str, TensorSpec]) -> None:
        #: What the next update is checked against (set per update, see SglangEngine._select_specs).
        self.specs = specs

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        return self.specs

    def apply(self, named: Sequence[tuple[str, Any]], *, owned: bool) -> None:
        return None


#: How long the relay waits for SGLang's loader to let go of the staging buffer (sleep, close).
FORGET_TIMEOUT_S = 60.0


class _RelayTarget:
    """A WeightTarget that hands every received bucket to SGLang over CUDA IPC: to the plugin's
    copy-plan loader where SGLang runs it, else as SGLang's flattened bucket (see :mod:`.payloads`).

    With option ``forward_buckets``, a bucket of the trainer's own tensors shared without packing
    (``cuda_ipc``) is forwarded, not staged, where SGLang runs the loader with one TP rank that can
    open the trainer's memory on its GPU (asked once, see :data:`.loader.PROBE`) and nothing is
    quantized here: the loader then reads the trainer's memory itself (:func:`.loader.shared_views`).

    With option ``direct_receive``, after the first update it received the relay makes SGLang's
    scheduler process a receiver of the session as its own rank (:meth:`start_door`,
    :data:`.loader.DOOR_PREFIX`); the engine then rings that process for each update it can take
    (:meth:`takes_direct`) while nothing runs in SGLang, and the relay's receiver sits it out."""

    def __init__(self, engine: SglangEngine, device: str, spec: TransportSpec) -> None:
        import torch

        from .loader import LOADER

        self.engine = engine
        self.device = torch.device(device)
        self.loop: asyncio.AbstractEventLoop | None = None
        #: How long SGLang may take to load one bucket (the weight transfer's timeout).
        self.timeout_s = 600.0
        self._stager: Any = None
        #: What the next update is checked against (set per update, see SglangEngine._select_specs).
        self.specs: Mapping[str, TensorSpec] = engine.expected_specs()
        runtime = engine.runtime
        use_loader = engine.options.copy_plan and LOADER in runtime.weight_loaders
        self.load_format = LOADER if use_loader else "flattened_bucket"
        self._sent_buffer: Any = None  # the staging buffer SGLang's loader was last sent
        self._forwards: bool | None = None  # whether buckets are forwarded (None: not asked yet)
        self._token: Any = None  # the tensor of a forwarded bucket's payload (not read)
        #: Buckets forwarded to SGLang's loader so far (read by tests and benchmarks).
        self.forwarded = 0
        self._mapped = False  # whether SGLang's loader may hold the trainer's memory open
        self._names: dict[tuple[Any, ...], str] = {}  # forwarded buckets' names, by what they carry
        self.spec = spec
        #: The doorbell to SGLang's scheduler (option direct_receive), once started.
        self.door: Doorbell | None = None
        #: Whether :meth:`start_door` ran for this weight transfer (it starts the doorbell or not, once).
        self.door_tried = False
        self._checked: tuple[Any, Any, bool] | None = None  # the layout and specs takes_direct checked
        #: Updates of this weight transfer that went through the doorbell.
        self.direct_receives = 0
        #: The last rings' (whole ring, the engine's write to the scheduler's thread running, the
        #: receive there, its answer to the engine having it) in seconds; see :meth:`ring_medians_ms`.
        self.rings: list[tuple[float, float | None, float | None, float | None]] = []

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        return self.specs

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffer held now (0: none)."""
        buffer = self._stager.buffer if self._stager is not None else None
        return 0 if buffer is None else int(buffer.numel())

    def _call(self, payloads: list[bytes]) -> None:
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(self.engine.runtime.update_from_tensor(payloads, self.load_format), self.loop)
        try:
            future.result(self.timeout_s)  # SGLang has loaded the bucket when this returns
        except TimeoutError:
            future.cancel()
            raise WeightSyncError(
                f"sglang: SGLang did not load a relayed bucket within {self.timeout_s:.0f} s (the weight "
                "transfer's timeout_s); see SGLang's log (option log_level='info')"
            ) from None

    def apply_shared(self, index: int, placements: Sequence[Any], shared: Any) -> bool:
        """Forward a zero-copy bucket to SGLang's loader (see the class docstring); False: stage it."""
        from .loader import LOADER, PROBE, shared_name

        runtime = self.engine.runtime
        if (not self.engine.options.forward_buckets or self.load_format != LOADER or runtime.tp_size != 1
                or self.engine._quantizes(self.specs)):
            return False
        if self._forwards is None:
            import torch

            self._token = torch.zeros(1, dtype=torch.uint8, device=self.device)
            try:
                self._call([runtime.serialize([(PROBE + shared.device_uuid, self._token)])])
                self._forwards = True
            except Exception as exc:  # noqa: BLE001 - any refusal means: stage instead
                logger.info("sglang: staging relayed buckets (SGLang's loader cannot read the trainer's memory: %s)", exc)
                self._forwards, self._token = False, None
        if not self._forwards:
            return False
        # A steady push forwards the same descriptions: their names are built once.
        key = (index, shared.device_uuid, shared.description, tuple((p.name, p.dtype, p.shape) for p in placements))
        name = self._names.get(key)
        if name is None:
            if len(self._names) >= 64:
                self._names.clear()
            name = self._names[key] = shared_name(index, shared.device_uuid, shared.description, placements)
        self._mapped = True
        self._call([runtime.serialize([(name, self._token)])])
        self.forwarded += 1
        return True

    def start_door(self) -> None:
        """Start the doorbell (once per weight transfer, after an update the relay received): SGLang's
        scheduler process becomes a receiver of the session as this relay's rank, and later updates
        may ring it (:mod:`.loader`). Only where that process can take the transfer's updates
        itself: a store-signalled transport (``shm``, ``cuda_ipc``), one TP rank, the copy-plan
        loader, and for ``cuda_ipc`` the trainer's GPU (checked there)."""
        from .loader import DOOR_TRANSPORTS, LOADER, door_name

        engine = self.engine
        if self.door_tried:
            return
        self.door_tried = True  # what decides it does not change while the weight transfer lasts
        if (not engine.options.direct_receive or not has_store(self.spec) or self.spec.transport not in DOOR_TRANSPORTS
                or self.load_format != LOADER or engine.runtime.tp_size != 1):
            return
        if (engine.options.model_extra or {}).get("sleep_on_idle") is False:
            # Seen on an H100 (benchmarks/RESULTS.md): with SGLang's scheduler spinning between
            # requests the doorbell's thread waited ~67 ms for the GIL per ring, a ~1B push took
            # 143 ms instead of 4.5 ms. SGLang's call is the faster path then.
            logger.info("sglang: direct_receive needs SGLang's sleep_on_idle (passed as False); pushes use "
                        "update_weights_from_tensor")
            return
        uuid = None
        if self.spec.transport == "cuda_ipc":
            from rollout_engines.weights.transports.cuda_ipc import device_uuid

            uuid = device_uuid(self.device)
        door, rank = new_door(), self.spec.rank_offset
        if self._token is None:
            import torch

            self._token = torch.zeros(1, dtype=torch.uint8, device=self.device)
        entry = door_name(self.spec.model_dump_json(), door, rank, uuid)
        try:
            self._call([engine.runtime.serialize([(entry, self._token)])])
            self.door = Doorbell(self.spec, door, [rank])
        except Exception as exc:  # noqa: BLE001 - the pushes still work, through the relay
            logger.warning("sglang: direct_receive: no doorbell to SGLang's scheduler (%s); pushes go through "
                           "the relay and update_weights_from_tensor", exc)

    def takes_direct(self, manifest: WeightManifest, quantizes: bool) -> bool:
        """Whether the doorbell's receiver can take ``manifest``: it is checked against this
        update's specs here (the scheduler takes it as described), and carries no delta (whose
        base the relay's receiver keeps) and nothing the relay would quantize."""
        if self.door is None or quantizes or manifest.delta is not None:
            return False
        checked = self._checked
        if (checked is None or checked[0] is not manifest.tensors or checked[1] is not self.specs
                or checked[2] != manifest.partial):
            try:
                validate_manifest(manifest, self.specs)
            except ManifestMismatch:
                return False  # the relay's receive drains the update and refuses it
            self._checked = (manifest.tensors, self.specs, manifest.partial)
        return True

    def ring_medians_ms(self) -> dict[str, float | None]:
        """Medians over the last rings (up to 64), in milliseconds: ``door_ring_ms`` (the engine's
        whole wait), ``door_wake_ms`` (its write of the ring to the scheduler's thread running),
        ``door_receive_ms`` (the receive there: the trainer's buckets, the copies),
        ``door_back_ms`` (the thread's answer to the engine having it); None before the first
        ring."""
        keys = ("door_ring_ms", "door_wake_ms", "door_receive_ms", "door_back_ms")
        columns = list(zip(*self.rings, strict=True)) if self.rings else [()] * 4
        out: dict[str, float | None] = {}
        for key, column in zip(keys, columns, strict=True):
            values = [v for v in column if v is not None]
            out[key] = round(statistics.median(values) * 1e3, 3) if values else None
        return out

    def rang(self, ring_s: float, answer: Mapping[str, Any], back: float) -> None:
        """Count one update received through the doorbell and keep where its time went."""
        timings = answer.get("timings")
        total = timings.get("total") if isinstance(timings, dict) else None
        answered = answer.get("answered")
        if len(self.rings) >= 64:
            del self.rings[:32]
        self.rings.append((ring_s, answer.get("wake_s"), total,
                           back - answered if isinstance(answered, float) else None))
        self.direct_receives += 1

    def apply(self, named: Sequence[tuple[str, Any]], *, owned: bool) -> None:
        from .payloads import Stager, loader_payloads, serialize_per_rank

        runtime = self.engine.runtime
        if self.engine._quantizes(self.specs):
            # BF16 into an FP8 engine: SGLang's loaders would cast without scales. Quantized here on
            # the relay's device into the checkpoint's form (weight + block scales), as the trainer
            # would with quantize="fp8_block", so both forms load the same bits.
            from rollout_engines.weights.fp8 import is_fp8_quantized, quantize_named

            named = list(quantize_named(
                (n, t.to(self.device, non_blocking=True) if is_fp8_quantized(n, t.shape) else t) for n, t in named
            ))
        # Always staged: a bucket may be on the CPU, or a CUDA IPC import that torch will not
        # share again; the copy runs at device bandwidth.
        if self._stager is None:
            self._stager = Stager(self.device)
        staged = self._stager.stage(named)
        if self.load_format == "flattened_bucket":
            payloads = serialize_per_rank(staged.flat, staged.metadata, runtime.tp_size, runtime.serialize)
        else:
            # The loader keeps its imports of the buffer (see .loader); a new buffer (grown) makes
            # it drop the old one's first.
            renewed = self._stager.buffer is not self._sent_buffer
            self._sent_buffer = self._stager.buffer
            payloads = loader_payloads(staged.flat, staged.metadata, runtime.tp_size, runtime.serialize,
                                       forget_first=renewed, name=staged.name)
        self._call(payloads)  # the staging is free again when this returns

    async def release(self, *, shared: bool = False) -> None:
        """Free the staging buffer (kept between pushes: the next push of the same layout reuses it
        and its views). SGLang's loader first lets go of its imports of it, which would hold the
        memory. ``shared``: the weight transfer ends; the loader also unmaps the trainer's memory it
        opened for forwarded buckets (kept over sleep: the trainer keeps it, and opening it again
        every step would cost a driver call per segment)."""
        stager, self._stager, self._sent_buffer = self._stager, None, None
        buffer = stager.buffer if stager is not None else None
        # FORGET_ALL also stops the scheduler's doorbell and closes its receiver.
        unmap = shared and (self._mapped or self.door is not None)
        if buffer is None and not unmap:
            return
        if self.load_format != "flattened_bucket":
            from .payloads import forget_payloads

            runtime = self.engine.runtime
            held = buffer if buffer is not None else self._token
            call = runtime.update_from_tensor(
                forget_payloads(held, runtime.tp_size, runtime.serialize, shared=unmap), self.load_format
            )
            try:
                await asyncio.wait_for(self.engine._unless_failed(call), timeout=min(FORGET_TIMEOUT_S, self.timeout_s))
            except Exception as exc:  # an engine failing or shutting down lets go of everything anyway
                logger.warning("SGLang's loader did not let go of the staging buffer: %s", exc)
        if unmap:
            self._mapped, self._forwards, self._token = False, None, None
        door = self.door
        if shared and door is not None:  # the loader stopped its listener on FORGET_ALL
            self.door, self.door_tried = None, False
            await asyncio.to_thread(door.close)
        del stager, buffer
        if self.device.type == "cuda":
            import torch

            torch.cuda.ipc_collect()  # blocks SGLang held are freed once it let go
