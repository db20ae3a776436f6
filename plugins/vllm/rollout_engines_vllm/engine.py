"""``VllmEngine``: vLLM's async engine (``AsyncLLM``) behind the rollout-engines interface.

Shape of a running engine::

    caller's event loop ──► VllmEngine ──► engine thread (own event loop, AsyncLLM) ──► EngineCore
                                                                                       process
                                                                       worker(s) + WorkerExtension
                                                                       (weight receivers)

- ``AsyncLLM`` binds its output handler to the event loop it first runs in. The engine owns a
  loop in a background thread and runs every vLLM call there, so one engine serves any caller:
  several pytest event loops, the blocking facade, a web server.
- ``AsyncLLM`` always runs the engine core in a separate process. On CPU the engine sets
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` by default, which keeps the worker inside that engine-core
  process (two processes instead of three: faster start, higher throughput); ``collective_rpc``
  and gloo groups work the same in both modes.
- Weights (and LoRA adapters, :mod:`.lora`) arrive in every worker through :mod:`.worker_ext`; the driver calls it with
  ``collective_rpc`` as an async task, concurrently with the trainer's send, or, with option
  ``direct_receive`` (on by default for CUDA) and no request running, rings the workers' threads
  through the weight-sync store (:mod:`rollout_engines.weights.doorbell`) while requests wait.
- Async RL: every prompt x sample is its own vLLM request (n=1, seed ``seed + i * n + k``, as vLLM
  seeds the samples of one request) under the caller's request id, so ``abort`` ends exactly the
  sequences named (vLLM answers an abort with the tokens made so far, ``finish_reason="abort"``).
  ``stream`` reads vLLM's delta outputs (``RequestOutputKind.DELTA``). ``pause("keep")`` is vLLM's
  ``pause_generation(mode="keep")``; after a push the kept requests are preempted by the prefix
  cache reset and recomputed under the new weights on resume. vLLM labels every output token with
  the weight version it was sampled under (``update_weight_version`` after each push), which gives
  ``token_weight_versions``. ``pause("abort")`` / ``pause("wait")`` abort by id / drain here
  (after a ``keep`` pause, with vLLM's scheduler unfrozen first).
  ``continue_from`` submits prompt + earlier tokens as the prompt and merges the outputs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from rollout_engines.backend_kit import (
    LoopThread,
    PrefixCacheTracker,
    check_continuations,
    check_passed_options,
    finish_reason,
    validate_prompts,
)
from rollout_engines.engine import Capabilities, Engine
from rollout_engines.errors import (
    BackendNotInstalled,
    EngineClosed,
    EngineUnavailable,
    InvalidRequest,
    WeightsInvalidated,
)
from rollout_engines.types import (
    MAX_LOGPROBS,
    Completion,
    Diagnostics,
    EngineConfig,
    FinishReason,
    GenerateRequest,
    LastReceive,
    PauseMode,
    ReceiveTimings,
    SamplingParams,
    StreamDelta,
    TokenLogprob,
)
from rollout_engines.weights.doorbell import Doorbell, has_store, new_door
from rollout_engines.weights.manifest import TransportSpec, WeightManifest, manifest_to_wire

from .plugin import CPU_TRANSPORTS, CUDA_TRANSPORTS, INSTALL_HINT

logger = logging.getLogger("rollout_engines.vllm")

T = TypeVar("T")

WORKER_EXTENSION = "rollout_engines_vllm.worker_ext.WorkerExtension"  # vLLM qualname: dots only
CPU_KV_CACHE_BYTES = 256 * 2**20
#: The values vLLM 0.32 accepts as max_lora_rank (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: How long a request waits for vLLM to confirm the weight version of the push before it (an engine
#: core that does not answer in this time has failed, and the request meets that error in vLLM).
LABEL_WAIT_S = 30.0
#: How often a request (or a control call) looks whether the workers' doorbell receive is done.
DOOR_NAP_S = 0.0002


def _label_done(task: concurrent.futures.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("vLLM did not take the weight version label: %r", task.exception())

#: vLLM's sleep mode swaps the CUDA allocator of the process for its own (a process-wide
#: singleton), so a second sleep-mode engine in one process breaks the first (vllm#18975).
_SLEEP_MODE_ENGINES: weakref.WeakSet[VllmEngine] = weakref.WeakSet()
_SLEEP_MODE_LOCK = threading.Lock()


class SleepModeEngineExists(EngineUnavailable):
    """Another sleep-mode vLLM engine is alive in this process; only one can be."""


#: vLLM arguments the engine sets itself, and where to set them instead.
_SET_HERE = {
    "model": "EngineConfig.model", "tokenizer": "EngineConfig.tokenizer", "dtype": "EngineConfig.dtype",
    "seed": "EngineConfig.seed", "tensor_parallel_size": "EngineConfig.tensor_parallel_size",
    "worker_extension_cls": "nothing (the weight receiver is this extension)",
    "disable_log_stats": "the option log_stats",
}


class VllmOptions(BaseModel):
    """The vLLM backend's own options (``create_engine("vllm", model=..., **options)``).

    Anything not listed here is passed to ``vllm.AsyncEngineArgs`` unchanged (for example
    ``max_num_seqs``, ``gpu_memory_utilization``, ``enable_prefix_caching``); a name that is not
    one of its fields, or one the engine sets itself (``seed``, ``dtype``, ...: set them in
    :class:`EngineConfig`), is refused before vLLM starts.
    """

    model_config = ConfigDict(extra="allow")

    multiprocessing: bool | None = Field(
        default=None,
        description="VLLM_ENABLE_V1_MULTIPROCESSING. None: off on CPU (worker inside the engine-core "
        "process), vLLM's default elsewhere.",
    )
    kv_cache_memory_bytes: int | None = Field(default=None, gt=0, description="None: 256 MiB on CPU.")
    enforce_eager: bool | None = Field(default=None, description="None: True on CPU (skips ~45 s of compile).")
    enable_sleep_mode: bool | None = Field(
        default=None, description="None: on for CUDA. At most one sleep-mode engine per process."
    )
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        default=None, description="Workers for tensor_parallel_size > 1: 'mp' (default) or 'ray'."
    )
    gpu_ids: list[int] | None = Field(default=None, description="CUDA_VISIBLE_DEVICES for the engine.")
    ray_bundle: dict[str, Any] | None = Field(
        default=None, description="Placement in a Ray placement group (rollout_engines.envs.RayBundle)."
    )
    weight_apply_mode: Literal["staged", "inplace"] = Field(
        default="staged",
        description="'staged': verify every bucket before loading any (needs a second copy of the "
        "update); 'inplace': load bucket by bucket, refuse generation if an update fails midway "
        "(CUDA only: on CPU, where weights load through reload_weights, updates are always staged).",
    )
    weight_quantization: Literal["none", "fp8_block"] = Field(
        default="none",
        description="'fp8_block': serve an FP8 copy of the (BF16) checkpoint, e4m3 weights with 128x128 "
        "block scales as in Qwen3/DeepSeek FP8 checkpoints (built once into the cache, "
        "rollout_engines.weights.fp8); pushes carry BF16 (quantized in the workers) or FP8 "
        "(WeightSync.push(quantize='fp8_block')). Named apart from vLLM's own 'quantization', which "
        "says how to read a checkpoint and still passes through.",
    )
    fp8_apply: Literal["auto", "reload"] = Field(
        default="auto",
        description="FP8 engines (weight_quantization): 'auto' writes pushed weights straight into "
        "the FP8 parameters where their layout is known (vLLM's block-scaled Cutlass/Triton kernels), "
        "else through vLLM's reload_weights; 'reload' always takes reload_weights.",
    )
    direct_receive: bool | None = Field(
        default=None,
        description="Start a push's receive (weights or a LoRA adapter) in the workers through the "
        "weight-sync store (a doorbell, "
        "rollout_engines.weights.doorbell) instead of vLLM's collective_rpc when no request runs: no "
        "round trip through the engine core's queues. For transports with a store (shm, cuda_ipc, gloo, "
        "nccl); other pushes go through the RPC as before. Default (None): on for CUDA engines, where "
        "pushes were measured faster with it, off on the CPU, where vLLM's reload_weights ran slower on "
        "the doorbell's thread. info().extra['direct_receive'] says what an engine uses.",
    )
    copy_plan: bool = Field(
        default=True,
        description="CUDA: learn where each tensor lands on the first push, then load later pushes "
        "by direct copies (rollout_engines.weights.copy_plan) instead of vLLM's per-tensor loaders.",
    )
    prefix_cache_isolation: Literal["reset", "salt"] = Field(
        default="reset",
        description="How prefixes computed with older weights are kept from being reused after a push. "
        "'reset': vLLM's prefix cache is reset after every update (it walks every cached block; "
        "requests running at the time, e.g. paused with mode 'keep', are preempted and recomputed "
        "with the new weights). 'salt': every request carries vLLM's cache_salt for the weight "
        "version it starts under, so old entries can never match and no reset is needed; requests "
        "kept across a push continue on the KV cache of the version they started under (vLLM's "
        "'keep' semantics), and old entries age out of the cache as it fills.",
    )
    pause_mode: Literal["keep", "wait", "abort"] | None = Field(
        default=None, description="Deprecated and ignored: pause(mode) says what happens to in-flight requests."
    )
    enable_lora: bool = Field(default=False, description="Serve LoRA adapters (WeightSync.push_lora).")
    max_lora_rank: int = Field(
        default=16, description="Largest adapter rank (vLLM's max_lora_rank: 1, 8, 16, 32, 64, 128, 256, 320 or 512)."
    )
    max_loras: int = Field(default=2, ge=1, description="Adapters loaded at once (vLLM's max_loras).")
    cache_root: str | None = Field(default=None, description="VLLM_CACHE_ROOT (compile caches).")
    hf_offline: bool = Field(default=True, description="HF_HUB_OFFLINE=1 (unless set) when the model is a local directory.")
    log_stats: bool = False

    @field_validator("max_lora_rank")
    @classmethod
    def _lora_rank(cls, v: int) -> int:
        if v not in VLLM_LORA_RANKS:
            raise ValueError(f"vLLM serves max_lora_rank {', '.join(map(str, VLLM_LORA_RANKS))}, not {v}")
        return v


def direct_receive_default(platform: str, option: bool | None) -> bool:
    """Option ``direct_receive`` as an engine on ``platform`` uses it: the option where given, else
    on for CUDA, where the doorbell made pushes faster, and off elsewhere, where vLLM's CPU
    ``reload_weights`` runs slower on the doorbell's thread (benchmarks/RESULTS.md)."""
    return option if option is not None else platform == "cuda"


def checkpoint_dtype(model: str) -> str | None:
    """The dtype a local checkpoint was saved in (config.json), if it is a float dtype.

    ``dtype="auto"`` means this dtype, as in the transformers engine (vLLM's own "auto" runs
    float32 checkpoints in half precision), so pushing the checkpoint's own tensors just works.
    """
    import json
    from pathlib import Path

    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    for source in (data, data.get("text_config") or {}):
        value = source.get("torch_dtype") or source.get("dtype")
        if value in ("float32", "float16", "bfloat16"):
            return str(value)
    return None


def _vllm_pause_modes() -> tuple[PauseMode, ...]:
    """``abort`` and ``wait`` are this engine's own (abort by request id, then drain); ``keep`` is
    vLLM's ``pause_generation(mode="keep")``, with vLLM's per-token weight-version labels (both in
    vLLM 0.32), so that a completion across a push records which tokens which weights made."""
    from vllm.v1.engine.async_llm import AsyncLLM

    pause = getattr(AsyncLLM, "pause_generation", None)
    keep = (
        pause is not None and "mode" in inspect.signature(pause).parameters
        and hasattr(AsyncLLM, "update_weight_version")
    )
    return ("abort", "wait", "keep") if keep else ("abort", "wait")


def _client_errors() -> tuple[type[BaseException], ...]:
    """Exception types vLLM raises for a request that does not fit the model (bad input)."""
    kinds: list[type[BaseException]] = [ValueError]
    try:
        from vllm.exceptions import VLLMClientError

        kinds.append(VLLMClientError)
    except ImportError:  # older vLLM raises ValueError
        pass
    return tuple(kinds)


def _top_list(step: Any) -> list[TokenLogprob]:
    """One position of vLLM logprobs (token id -> Logprob: the top k and the chosen token), most
    likely first."""
    items = [TokenLogprob(token_id=int(t), logprob=float(lp.logprob)) for t, lp in step.items()]
    items.sort(key=lambda t: t.logprob, reverse=True)
    return items


@dataclass(eq=False)
class _Seq:
    """One prompt x sample: one vLLM request under the caller's request id, and what it made."""

    rid: str
    prompt_index: int
    sample_index: int
    prompt: dict[str, Any]  # vLLM's prompt input (prompt + earlier tokens for a continuation)
    params: Any  # vLLM SamplingParams
    prompt_len: int | None  # tokens of the caller's prompt when ``prompt`` also holds earlier ones
    prior: Completion | None
    want_logprobs: bool
    want_top: bool
    prompt_top_k: int
    lora_name: str | None = None  # GenerateRequest.lora
    lora: Any = None  # that adapter's version, chosen when registered (lora.LoadedLora)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[TokenLogprob]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[TokenLogprob]] | None = None
    finish: FinishReason | None = None
    delivered: int = 0  # tokens a stream has handed out
    final_sent: bool = False
    started: bool = False  # generate() was called in vLLM
    aborted: bool = False
    done: bool = False


class VllmEngine(Engine):
    """A vLLM engine. Create it with ``rollout_engines.create_engine("vllm", model=PATH, ...)``."""

    backend_name: ClassVar[str] = "vllm"
    #: Updates are applied in vLLM's engine core, between two steps: generation stops meanwhile.
    updates_hold_generation: ClassVar[bool] = True
    #: Declared for listings; each instance replaces it with its platform's (see _capabilities_for).
    capabilities = Capabilities(
        chat=True, logprobs=True, n=True, stop_strings=True, seed=True, pause=True, prefix_cache=True,
        transports=CPU_TRANSPORTS, tensor_parallel=True, multi_process=True, pause_modes=("abort", "wait", "keep"),
        streaming=True, abort=True, top_logprobs=MAX_LOGPROBS, prompt_logprobs=True, continuation=True,
    )

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.options = VllmOptions.model_validate(config.options)
        self._engine_loop: LoopThread | None = None
        self._llm: Any = None
        self._sleep_registered = False
        # A reset (O(KV blocks) in vLLM) is skipped when no request was submitted since the last.
        self._cache = PrefixCacheTracker()
        #: Running prompt x samples by request id (registered by the caller's thread, ended on the
        #: engine loop).
        self._seqs: dict[str, _Seq] = {}
        self._seqs_lock = threading.Lock()
        self._abort_tasks: set[asyncio.Future[None]] = set()
        self._vllm_paused = False  # vLLM's scheduler frozen by pause("keep") (it answered)
        self._vllm_freezing = False  # pause("keep") asked vLLM to freeze: resume() unfreezes
        self._label_version = 0  # the weight version vLLM labels new tokens with
        self._label_task: concurrent.futures.Future[None] | None = None  # vLLM told the last push's version
        self._door: Doorbell | None = None  # option direct_receive, while a weight transfer is open
        self._direct_receives = 0  # updates the doorbell handed to the workers (info().extra)
        if self.options.pause_mode is not None:
            logger.warning("vLLM option pause_mode is deprecated and ignored; pass the mode to pause(mode)")
        self._setup_process_env()
        try:
            import vllm  # noqa: F401
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise BackendNotInstalled("vllm", INSTALL_HINT, cause=str(exc)) from exc
        self.platform = "cuda" if current_platform.is_cuda() else "cpu" if current_platform.is_cpu() else str(
            getattr(current_platform, "device_type", "other")
        )
        self.sleep_mode = self._want_sleep_mode()
        self.capabilities = self._capabilities_for(self.platform, self.sleep_mode)
        # Option direct_receive resolved for this platform (info().extra shows it).
        self.options = self.options.model_copy(
            update={"direct_receive": direct_receive_default(self.platform, self.options.direct_receive)})
        self._loras: Any = None
        if self.options.enable_lora:
            from .lora import VllmLoras

            self.capabilities = self.capabilities.model_copy(
                update={"lora": self.options.max_lora_rank, "max_loras": self.options.max_loras}
            )
            self._loras = VllmLoras(self)
        if self.sleep_mode:
            self._claim_sleep_mode()
        try:
            self._start()
        except BaseException:
            self._shutdown_quietly()
            raise

    # ---- start-up --------------------------------------------------------------------------------
    def _setup_process_env(self) -> None:
        from rollout_engines.envs import setup_device_env

        opts = self.options
        if opts.hf_offline and os.path.isdir(self.config.model):
            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local model needs no hub lookups
        if opts.cache_root:
            os.environ["VLLM_CACHE_ROOT"] = opts.cache_root
        gpu_ids = opts.gpu_ids
        if gpu_ids is None and self.config.device and self.config.device.startswith("cuda:"):
            first = int(self.config.device.split(":", 1)[1])
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            logical = list(range(first, first + self.config.tensor_parallel_size))
            physical = visible.split(",") if visible else None
            gpu_ids = [int(physical[i]) if physical else i for i in logical]  # type: ignore[index]
        if gpu_ids is not None or opts.ray_bundle is not None:
            setup_device_env("vllm", gpu_ids=gpu_ids, ray_bundle=opts.ray_bundle)
        tp = self.config.tensor_parallel_size
        if tp > 1 and self._platform_guess() == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM's automatic binding wants one NUMA node per CPU worker and refuses to start
            # otherwise; split this process's cores between the workers instead.
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            if len(cores) >= tp:
                size = len(cores) // tp
                groups = [cores[i * size:(i + 1) * size] for i in range(tp)]
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
        multiprocessing = opts.multiprocessing
        if multiprocessing is None and self._platform_guess() == "cpu":
            multiprocessing = False
        if multiprocessing is not None:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
        if self._platform_guess() == "cuda":
            # A trainer has usually touched CUDA already; a forked engine core then fails with
            # "Cannot re-initialize CUDA in forked subprocess" (seen on the H200).
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    def _platform_guess(self) -> str:
        """The platform before vLLM is imported (vLLM reads the variable at import and start)."""
        if self.config.device:
            return "cpu" if self.config.device == "cpu" else "cuda"
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            distribution("vllm-cpu")
            return "cpu"
        except PackageNotFoundError:
            return "cuda"

    def _want_sleep_mode(self) -> bool:
        wanted = self.options.enable_sleep_mode
        if self.platform != "cuda":
            if wanted:
                logger.warning("vLLM sleep mode is CUDA-only; ignored on %s", self.platform)
            return False
        return True if wanted is None else wanted

    @staticmethod
    def _capabilities_for(platform: str, sleep_mode: bool) -> Capabilities:
        return Capabilities(
            chat=True, logprobs=True, n=True, stop_strings=True, seed=True, pause=True, prefix_cache=True,
            sleep_levels=(1, 2) if sleep_mode else (),
            sleep_tags=("weights", "kv_cache") if sleep_mode else (),
            weights_kept_on_sleep=True,  # level 1 offloads them; level 2 is handled by the base class
            transports=CUDA_TRANSPORTS if platform == "cuda" else CPU_TRANSPORTS,
            tensor_parallel=True,
            multi_process=True,
            pause_modes=_vllm_pause_modes(),
            streaming=True,
            abort=True,
            top_logprobs=MAX_LOGPROBS,  # narrowed to the engine's max_logprobs once it runs
            prompt_logprobs=True,
            continuation=True,
        )

    def _claim_sleep_mode(self) -> None:
        with _SLEEP_MODE_LOCK:
            alive = [e for e in _SLEEP_MODE_ENGINES if not e.closed]
            if alive:
                raise SleepModeEngineExists(
                    "another vLLM engine with sleep mode is alive in this process "
                    f"(model {alive[0].config.model!r}); vLLM allows one per process (vllm#18975). "
                    "Close it first, start this one with enable_sleep_mode=False, or run it in another "
                    "process (e.g. a Ray actor)"
                )
            _SLEEP_MODE_ENGINES.add(self)
            self._sleep_registered = True

    def _served_model(self) -> str:
        """The checkpoint vLLM loads: the model, or its FP8 block copy (``weight_quantization``)."""
        if self.options.weight_quantization == "none":
            return self.config.model
        from rollout_engines.weights.fp8 import served_checkpoint

        from .checkpoint import resolve_model_dir

        return served_checkpoint(resolve_model_dir(self.config.model), self.options.weight_quantization)

    def engine_args(self) -> Any:
        """The ``vllm.AsyncEngineArgs`` this engine starts with."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        cfg, opts = self.config, self.options
        cpu = self.platform == "cpu"
        kwargs: dict[str, Any] = dict(opts.model_extra or {})
        set_here = {**_SET_HERE, "max_cpu_loras": "the option max_loras (max_cpu_loras is twice it)"} \
            if opts.enable_lora else _SET_HERE
        check_passed_options(kwargs, AsyncEngineArgs, library="vllm.AsyncEngineArgs", own=VllmOptions.model_fields,
                             set_here=set_here)
        kwargs.update(
            model=self._served_model(),
            tokenizer=cfg.tokenizer or cfg.model,
            dtype=cfg.dtype if cfg.dtype != "auto" else (checkpoint_dtype(cfg.model) or "auto"),
            seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=not opts.log_stats,
        )
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        executor = opts.distributed_executor_backend
        if executor is None and opts.ray_bundle is not None:
            executor = opts.ray_bundle.get("executor", "ray")  # as placed by setup_device_env
        if cfg.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = executor or "mp"
        elif executor == "ray":
            kwargs["distributed_executor_backend"] = "ray"
        enforce_eager = opts.enforce_eager if opts.enforce_eager is not None else cpu
        if enforce_eager:
            kwargs["enforce_eager"] = True
        kv_bytes = opts.kv_cache_memory_bytes or (CPU_KV_CACHE_BYTES if cpu else None)
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_bytes
        if self.sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if opts.enable_lora:
            # room in vLLM's adapter cache for the version each adapter's last push retired (removed at the next push)
            kwargs.update(enable_lora=True, max_lora_rank=opts.max_lora_rank, max_loras=opts.max_loras,
                          max_cpu_loras=2 * opts.max_loras)
        return AsyncEngineArgs(**kwargs)

    def _start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self.engine_args()
        self._engine_loop = LoopThread("roe-vllm-loop")
        start = time.perf_counter()

        async def make() -> Any:
            # Built inside the engine loop so AsyncLLM's output handler lives there.
            return AsyncLLM.from_engine_args(args)

        self._llm = self._engine_loop.run(make())
        self._tokenizer = self._llm.get_tokenizer()
        model_config = self._llm.model_config
        self._max_model_len: int | None = getattr(model_config, "max_model_len", None)
        self._vocab_size: int | None = model_config.get_vocab_size() if hasattr(model_config, "get_vocab_size") else None
        self._workers: list[dict[str, Any]] = self._sync(lambda: self._llm.collective_rpc("roe_worker_info"))
        max_logprobs = int(getattr(self._llm.model_config, "max_logprobs", MAX_LOGPROBS))
        if 0 <= max_logprobs < MAX_LOGPROBS:
            self.capabilities = self.capabilities.model_copy(update={"top_logprobs": max_logprobs})
        self._start_label(self._label_version)  # requests wait for it (see _drive)
        logger.info(
            "vLLM engine on %s started in %.1f s (%d worker(s), platform %s)", self.config.model,
            time.perf_counter() - start, len(self._workers), self.platform,
        )

    def _start_label(self, version: int) -> None:
        """Tell vLLM the weight version, which it records per output token (WeightVersionSpan): at
        start-up, and right after a push landed, before anything else may reach vLLM. Without waiting
        for its answer, a round trip to the engine core that the push need not wait for (about 1 ms
        on a CPU): :meth:`_drive` lets no request go to vLLM before the label is answered, so every
        request submitted after the push is labelled with its version; tokens of requests already
        running get vLLM's label as they did when the push waited for it (steps may run between the
        push and the label either way)."""
        self._label_version = version
        llm, loop = self._llm, self._engine_loop
        if not hasattr(llm, "update_weight_version") or loop is None or loop.closed:
            return
        label = loop.submit(lambda: llm.update_weight_version(str(version)))
        label.add_done_callback(_label_done)
        self._label_task = label

    # ---- running coroutines on the engine loop -----------------------------------------------------
    def _sync(self, factory: Callable[[], Awaitable[T]]) -> T:
        assert self._engine_loop is not None
        return self._engine_loop.run(factory)

    async def _on_loop(self, factory: Callable[[], Awaitable[T]]) -> T:
        """Await ``factory()`` on the engine loop from any caller loop (cancellation propagates);
        after a receive the doorbell started, if one runs."""
        if self._engine_loop is None or self._engine_loop.closed:
            raise EngineClosed("vLLM engine is closed; create a new one")
        await self._door_idle()
        return await self._engine_loop.call(factory)

    async def _door_idle(self) -> None:
        """Wait while the workers receive an update the doorbell handed them (nothing else may run
        in vLLM then; a ring is bounded by its update's timeout and ends in its own thread)."""
        door = self._door
        while door is not None and door.busy:
            await asyncio.sleep(DOOR_NAP_S)

    # ---- generation ----------------------------------------------------------------------------------
    def _vllm_sampling(self, s: SamplingParams, seed: int | None, *, delta: bool = False) -> Any:
        """vLLM's parameters for one prompt x sample (n=1: each sample is its own vLLM request, under
        its own request id, so that abort finds it)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        # vLLM's logprobs=k: the k most likely tokens plus the sampled one; 0: the sampled one only.
        logprobs = s.top_logprobs if s.top_logprobs is not None else (0 if s.logprobs is not None else None)
        try:
            return VSamplingParams(
                n=1,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                min_p=s.min_p,
                max_tokens=s.max_tokens,
                stop=list(s.stop) or None,
                stop_token_ids=list(s.stop_token_ids) or None,
                ignore_eos=s.ignore_eos,
                seed=seed,
                logprobs=logprobs,
                prompt_logprobs=s.prompt_logprobs,
                output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
            )
        except _client_errors() as exc:
            # vLLM checks bounds of its own (temperature at most 2.0) as the params are built, and
            # raises an error that is no ValueError: the request fails alone, with the typed error.
            raise InvalidRequest(f"vLLM rejected the sampling parameters: {exc}") from exc

    def _prompts(self, request: GenerateRequest) -> list[list[int]]:
        """Every prompt's token ids, checked by the core's prompt rules. Text is tokenized here as
        vLLM would (special tokens added), so the rules see every prompt."""
        if request.prompt_token_ids is not None:
            prompts = [list(ids) for ids in request.prompt_token_ids]
        elif request.prompts is not None:
            prompts = [list(self._tokenizer.encode(text)) for text in request.prompts]
        else:
            assert request.messages is not None
            prompts = []
            for chat in request.messages:
                text = self._tokenizer.apply_chat_template(
                    [m.model_dump() for m in chat], add_generation_prompt=True, tokenize=False
                )
                prompts.append(list(self._tokenizer.encode(text, add_special_tokens=False)))
        priors = request.continue_from
        validate_prompts(
            prompts, max_tokens=request.sampling.max_tokens, max_model_len=self._max_model_len,
            vocab_size=self._vocab_size, continued=[p.token_ids for p in priors] if priors is not None else None,
        )
        return prompts

    def _plan(self, request: GenerateRequest, *, delta: bool) -> list[_Seq]:
        """One vLLM request per prompt x sample, prompt-major, each under its request id. Sample k
        of prompt i is seeded ``seed + i * n + k``: what vLLM gives the samples of one n-request
        seeded ``seed + i * n``."""
        s = request.sampling
        prompts = self._prompts(request)
        rids = request.sequence_ids()
        priors = request.continue_from
        check_continuations(request)
        salt = f"roe-weights-v{self.weight_version}" if self.options.prefix_cache_isolation == "salt" else None
        seqs = []
        for i, ids in enumerate(prompts):
            prior = priors[i] if priors is not None else None
            prompt_len = None
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if prior is not None:
                prompt_len = len(ids)
                prompt = {"prompt_token_ids": [*ids, *prior.token_ids]}
            if salt is not None:
                prompt["cache_salt"] = salt
            for k in range(s.n):
                index = i * s.n + k
                seed = None if s.seed is None else (s.seed + index + 2**63) % 2**64 - 2**63
                seqs.append(_Seq(
                    rid=rids[index], prompt_index=i, sample_index=k, prompt=prompt,
                    params=self._vllm_sampling(s, seed, delta=delta), prompt_len=prompt_len, prior=prior,
                    want_logprobs=s.logprobs is not None, want_top=s.top_logprobs is not None,
                    prompt_top_k=s.prompt_logprobs or 0, lora_name=request.lora,
                ))
        return seqs

    def _register(self, seqs: list[_Seq]) -> None:
        with self._seqs_lock:
            taken = next((q.rid for q in seqs if q.rid in self._seqs), None)
            if taken is not None:
                raise InvalidRequest(
                    f"request id {taken!r} belongs to a request that is still running; request ids must be "
                    "unique among running requests"
                )
            for q in seqs:
                if q.lora_name is not None:  # under the lock: a LoRA push retires no version chosen here
                    q.lora = self._loras.select(q.lora_name)
                self._seqs[q.rid] = q

    def _unregister(self, seqs: list[_Seq]) -> None:
        with self._seqs_lock:
            for q in seqs:
                if self._seqs.get(q.rid) is q:
                    del self._seqs[q.rid]

    async def _drive(self, llm: Any, seq: _Seq, notify: Callable[[], None] | None = None) -> None:
        """Run one prompt x sample in vLLM (on the engine loop); ``notify`` after each output."""
        try:
            await self._door_idle()
            label = self._label_task
            if label is not None and not label.done():  # the last push's version reaches vLLM first
                await asyncio.wait([asyncio.wrap_future(label)], timeout=LABEL_WAIT_S)
            if not seq.aborted:  # aborted before it reached vLLM: answered here, with no tokens
                seq.started = True
                lora_request = seq.lora.request if seq.lora is not None else None
                async for out in llm.generate(seq.prompt, seq.params, seq.rid, lora_request=lora_request):
                    self._absorb(seq, out)
                    if notify is not None:
                        notify()
            if seq.finish is None:
                seq.finish = "abort"
        finally:
            seq.done = True
            self._unregister([seq])
            if notify is not None:
                notify()

    def _absorb(self, seq: _Seq, out: Any) -> int:
        """Add a vLLM output (a delta, or the one final output) to ``seq``; returns where its new
        tokens start."""
        if seq.prompt_ids is None and out.prompt_token_ids is not None:
            seq.prompt_ids = list(out.prompt_token_ids)[: seq.prompt_len]
        if seq.prompt_logprobs is None and out.prompt_logprobs:
            self._absorb_prompt_logprobs(seq, out.prompt_logprobs)
        start = len(seq.tokens)
        version = self._label_version  # read as vLLM makes them; vLLM's own spans replace these at the end
        for sample in out.outputs[:1]:
            ids = list(sample.token_ids)
            seq.tokens += ids
            seq.text += sample.text or ""
            seq.versions += [version] * len(ids)
            if (seq.want_logprobs or seq.want_top) and sample.logprobs is not None:
                for tok, step in zip(ids, sample.logprobs, strict=False):
                    if seq.want_logprobs:
                        seq.logprobs.append(float(step[tok].logprob))
                    if seq.want_top:
                        seq.top.append(_top_list(step))
            if sample.finish_reason is not None:
                seq.finish = finish_reason(sample.finish_reason)
                self._versions_from_spans(seq, getattr(sample, "weight_versions", None))
        if out.finished and seq.finish is None:
            seq.finish = "abort"
        return start

    def _versions_from_spans(self, seq: _Seq, spans: Any) -> None:
        """vLLM's own record of which weights sampled each token (labels set by _start_label)."""
        if not spans:
            return
        versions = list(seq.versions)
        for span in spans:
            try:
                label = int(span.version)
            except (TypeError, ValueError):
                continue
            versions[span.start:span.end] = [label] * (span.end - span.start)
        seq.versions = versions[: len(seq.tokens)]

    @staticmethod
    def _absorb_prompt_logprobs(seq: _Seq, entries: Any) -> None:
        n = seq.prompt_len if seq.prompt_len is not None else len(entries)
        prompt = seq.prompt["prompt_token_ids"] if "prompt_token_ids" in seq.prompt else seq.prompt_ids or []
        values: list[float | None] = [None]
        tops: list[list[TokenLogprob]] = [[]]
        for j in range(1, min(n, len(entries), len(prompt))):
            step = entries[j]
            entry = step.get(prompt[j]) if step else None
            values.append(None if entry is None else float(entry.logprob))
            tops.append(_top_list(step) if step else [])
        seq.prompt_logprobs = values
        seq.prompt_top = tops if seq.prompt_top_k else None

    def _take_deltas(self, seq: _Seq) -> list[StreamDelta]:
        """What the consumer has not seen of ``seq``: one delta per run of tokens of one weight
        version; the last one carries the finish reason once the sequence has ended."""
        a, b = seq.delivered, len(seq.tokens)
        final = seq.finish is not None and not seq.final_sent
        if b <= a and not final:
            return []
        prior = seq.prior
        if a:
            last = seq.versions[a - 1]
        elif prior is not None and prior.token_ids:
            last = prior.versions()[-1]
        else:
            last = self._label_version
        cuts = [j for j in range(a + 1, b) if seq.versions[j] != seq.versions[j - 1]]
        deltas = []
        for lo, hi in zip([a, *cuts], [*cuts, b], strict=True):
            deltas.append(StreamDelta(
                request_id=seq.rid, prompt_index=seq.prompt_index, sample_index=seq.sample_index,
                token_ids=seq.tokens[lo:hi],
                logprobs=seq.logprobs[lo:hi] if seq.want_logprobs else None,
                top_logprobs=seq.top[lo:hi] if seq.want_top else None,
                weight_version=seq.versions[hi - 1] if hi > lo else last,
                lora=seq.lora.name if seq.lora is not None else None,
                lora_version=seq.lora.version if seq.lora is not None else None,
            ))
        if final:
            deltas[-1].finish_reason = seq.finish
        seq.delivered, seq.final_sent = b, seq.final_sent or final
        return deltas

    def _completion(self, seq: _Seq) -> Completion:
        prior = seq.prior
        versions = (prior.versions() if prior is not None else []) + seq.versions
        logprobs = top = None
        if seq.want_logprobs:
            logprobs = (list(prior.logprobs or []) if prior is not None else []) + seq.logprobs
        if seq.want_top:
            top = (list(prior.top_logprobs or []) if prior is not None else []) + seq.top
        prompt_ids = seq.prompt_ids
        if prompt_ids is None:  # never reached vLLM (aborted first)
            ids = seq.prompt.get("prompt_token_ids")
            prompt_ids = list(ids)[: seq.prompt_len] if ids is not None else []
        return Completion(
            prompt_index=seq.prompt_index, sample_index=seq.sample_index, request_id=seq.rid,
            prompt_token_ids=prompt_ids,
            token_ids=(list(prior.token_ids) if prior is not None else []) + seq.tokens,
            text=(prior.text if prior is not None else "") + seq.text,
            logprobs=logprobs, top_logprobs=top,
            prompt_logprobs=seq.prompt_logprobs, prompt_top_logprobs=seq.prompt_top,
            finish_reason=seq.finish or "abort",
            weight_version=versions[-1] if versions else self.weight_version,
            token_weight_versions=versions if len(set(versions)) > 1 else None,
            lora=seq.lora.name if seq.lora is not None else None,
            lora_version=seq.lora.version if seq.lora is not None else None,
        )

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        seqs = self._plan(request, delta=False)
        self._register(seqs)
        llm = self._llm
        self._cache.submitted()

        async def run() -> None:
            tasks = [asyncio.ensure_future(self._drive(llm, q)) for q in seqs]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:  # cancelling a vLLM generate() aborts its request
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        try:
            await self._on_loop(run)
        except _client_errors() as exc:
            raise InvalidRequest(f"vLLM rejected the request: {exc}") from exc
        finally:
            self._unregister(seqs)
        return [self._completion(q) for q in seqs]

    async def _stream(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        """vLLM's delta outputs, read by one task per prompt x sample on the engine loop as soon as
        vLLM makes them (so each token is tagged with the weights current then); the consumer takes
        what is new since its last take. vLLM cannot be slowed per request, so what waits for a
        slow consumer is what was made since its last take (at most ``max_tokens`` a sequence)."""
        seqs = self._plan(request, delta=True)
        self._register(seqs)
        llm, engine_loop = self._llm, self._engine_loop
        self._cache.submitted()
        state: dict[str, Any] = {}

        async def start() -> None:
            event = asyncio.Event()

            async def drive(seq: _Seq) -> None:
                try:
                    await self._drive(llm, seq, event.set)
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:
                    state.setdefault("error", exc)
                    event.set()

            state["event"] = event
            state["tasks"] = [asyncio.ensure_future(drive(q)) for q in seqs]

        async def take() -> list[StreamDelta]:
            event = state["event"]
            while True:
                event.clear()
                if "error" in state:
                    raise state["error"]
                deltas = [d for q in seqs for d in self._take_deltas(q)]
                if deltas:
                    return deltas
                await event.wait()

        try:
            await self._on_loop(start)
            while not all(q.final_sent for q in seqs):
                try:
                    deltas = await self._on_loop(take)
                except _client_errors() as exc:
                    raise InvalidRequest(f"vLLM rejected the request: {exc}") from exc
                for delta in deltas:
                    yield delta
        finally:
            tasks = state.get("tasks", [])
            if tasks and engine_loop is not None and not engine_loop.closed:
                engine_loop.loop.call_soon_threadsafe(lambda: [t.cancel() for t in tasks if not t.done()])  # aborts in vLLM
            self._unregister(seqs)

    async def _abort(self, request_ids: Sequence[str] | None) -> None:
        with self._seqs_lock:
            if request_ids is None:
                seqs = list(self._seqs.values())
            else:
                seqs = [self._seqs[r] for r in dict.fromkeys(request_ids) if r in self._seqs]
            for q in seqs:
                q.aborted = True
        if not seqs or self._llm is None:
            return
        llm = self._llm

        async def go() -> None:
            await llm.abort([q.rid for q in seqs])
            # A request between its generate() call and vLLM registering it is not found by that
            # abort: abort again until each has ended.
            task = asyncio.ensure_future(self._abort_until_done(llm, seqs))
            self._abort_tasks.add(task)
            task.add_done_callback(self._abort_tasks.discard)

        await self._on_loop(go)

    async def _abort_until_done(self, llm: Any, seqs: list[_Seq]) -> None:
        delay = 0.01
        while any(not q.done for q in seqs) and self._llm is llm:
            await asyncio.sleep(delay)
            delay = min(0.1, delay * 2)
            live = [q.rid for q in seqs if q.started and not q.done]
            if live:
                await llm.abort(live)

    # ---- cache, pause, sleep ---------------------------------------------------------------------------
    async def _reset_prefix_cache(self) -> None:
        if "kv_cache" in self._asleep:
            return  # nothing cached while the KV cache is released; wake_up resets it
        submitted = self._cache.dirty()
        if submitted is None:
            self._last_reset_s = 0.0  # nothing generated since the last reset: nothing cached
            return
        start = time.perf_counter()
        try:
            if await self._reset_prefix_cache_now():
                self._cache.reset_done(submitted)
        finally:
            self._last_reset_s = round(time.perf_counter() - start, 6)

    async def _forget_cached_prefixes(self) -> None:
        if self.options.prefix_cache_isolation == "salt":
            self._last_reset_s = 0.0  # new requests carry the new version's salt: nothing to reset
            return
        await self._reset_prefix_cache()

    async def _reset_prefix_cache_now(self) -> bool:
        llm = self._llm

        async def reset() -> bool:
            ok = await llm.reset_prefix_cache()
            if ok is False and "reset_running_requests" in inspect.signature(llm.reset_prefix_cache).parameters:
                # Running requests hold cached blocks: preempt them so nothing computed with the old
                # weights is reused (they are recomputed with the new ones).
                ok = await llm.reset_prefix_cache(reset_running_requests=True)
            if ok is False:
                logger.warning("vLLM could not reset its prefix cache (blocks still in use)")
            return ok is not False

        return await self._on_loop(reset)

    async def _pause(self, mode: PauseMode) -> None:
        """The base class holds new requests. ``keep``: vLLM's scheduler freezes the running ones
        (pause_generation(mode="keep")); ``abort``: they are aborted by id; ``abort`` and ``wait``
        return once every request in flight has ended. A ``wait`` or ``abort`` pause after a ``keep``
        one unfreezes vLLM's scheduler (the base class still holds new requests): frozen requests
        could neither drain nor end."""
        llm = self._llm
        if mode == "keep":
            # Marked first: a pause cancelled once vLLM froze (its answer still on the way) is
            # undone by resume() all the same. _vllm_paused (the doorbell may ring beside frozen
            # requests) only once vLLM answered.
            self._vllm_freezing = True
            await self._on_loop(lambda: llm.pause_generation(mode="keep", clear_cache=False))
            self._vllm_paused = True
            return
        if mode == "abort":
            await self._abort(None)
        await self._unfreeze()
        while self._outstanding or self._seqs:
            await asyncio.sleep(0.005)

    async def _unfreeze(self) -> None:
        """Undo ``pause("keep")``'s freeze of vLLM's scheduler (if this vLLM can)."""
        llm = self._llm
        if (self._vllm_paused or self._vllm_freezing) and hasattr(llm, "resume_generation"):
            await self._on_loop(llm.resume_generation)
        self._vllm_paused = self._vllm_freezing = False

    async def _resume(self) -> None:
        await self._unfreeze()

    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        llm = self._llm
        wanted = set(tags)
        if wanted == {"kv_cache"} and hasattr(llm, "release_kv_cache_memory"):
            await self._on_loop(llm.release_kv_cache_memory)
            return
        # vLLM's sleep releases weights and KV cache together; a single tag is had by waking the
        # other one right away (it costs one offload round trip of what stays).
        # Level 1 when the weights are to stay: level 2 would discard them.
        await self._on_loop(lambda: llm.sleep(level if "weights" in wanted else 1))
        keep = sorted({"weights", "kv_cache"} - wanted)
        if keep:
            await self._on_loop(lambda: llm.wake_up(tags=keep))
            if "kv_cache" in keep:
                # The KV cache came back empty: forget the prefixes it held.
                await self._on_loop(llm.reset_prefix_cache)

    async def _wake_up(self, tags: Sequence[str]) -> None:
        llm = self._llm
        await self._on_loop(lambda: llm.wake_up(tags=list(tags)))

    # ---- weights -------------------------------------------------------------------------------------
    async def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        llm = self._llm
        return await self._on_loop(lambda: llm.collective_rpc(method, timeout=timeout, args=args))

    def weight_receivers(self) -> int:
        return len(self._workers)

    async def _diagnostics(self, fingerprint: bool) -> Diagnostics:
        """Adds the platform, the dtype pushes must carry (the engine's, after ``auto`` was resolved)
        and, asked for on CUDA, every worker's parameter sums as the weights fingerprint (none on
        the CPU, where vLLM repacks linear weights out of their parameters)."""
        base = await super()._diagnostics(fingerprint)
        update: dict[str, Any] = {"platform": self.platform}
        if self._llm is not None:
            update["weights_dtype"] = str(self._llm.model_config.dtype).removeprefix("torch.")
            if fingerprint and self.platform == "cuda":
                update["weights_fingerprint"] = await self._rpc("roe_param_checksum")
        return base.model_copy(update=update)

    # ---- for direct baselines (rollout_engines_vllm.bench) -------------------------------------------
    @property
    def async_llm(self) -> Any:
        """The vLLM ``AsyncLLM`` this engine drives (None once closed); call it on its loop
        (:meth:`run_on_engine_loop`)."""
        return self._llm

    @property
    def tokenizer(self) -> Any:
        """vLLM's tokenizer of the served model."""
        return self._tokenizer

    def vllm_sampling_params(self, sampling: SamplingParams, seed: int | None = None) -> Any:
        """The vLLM ``SamplingParams`` this engine sends for one prompt x sample of ``sampling``."""
        return self._vllm_sampling(sampling, seed)

    def run_on_engine_loop(self, factory: Callable[[], Awaitable[T]]) -> T:
        """Run ``factory()`` on the engine's own event loop (where ``AsyncLLM`` lives) and wait for it,
        from a thread that is not that loop's."""
        return self._sync(factory)

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        from .worker_ext import raise_worker_error

        await self._drop_door()
        door = new_door() if self.options.direct_receive and has_store(spec) else None
        worker_options = {"mode": self.options.weight_apply_mode, "copy_plan": self.options.copy_plan,
                          "fp8_apply": self.options.fp8_apply, "doorbell": door}
        results = await self._rpc(
            "roe_init_weight_transfer", spec.model_dump_json(), worker_options, timeout=spec.timeout_s + 30
        )
        raise_worker_error(results, f"joining the '{spec.transport}' weight sync")
        if door is not None and all(r.get("door") for r in results):
            ranks = [int(r["rank"]) for r in results]
            try:
                self._door = await asyncio.to_thread(Doorbell, spec, door, ranks)
            except Exception as exc:  # the pushes still work, through the RPC
                logger.warning("direct_receive: could not reach the weight-sync store (%s); pushes use the RPC", exc)

    async def _drop_door(self) -> None:
        door, self._door = self._door, None
        if door is not None:
            await asyncio.to_thread(door.close)

    def _claim_door(self, manifest: WeightManifest) -> Doorbell | None:
        """The doorbell, marked busy, if this update may go through it: nothing runs in the workers
        while they receive, because no request is in vLLM or vLLM's scheduler is frozen
        (``pause("keep")``: it steps nothing until resumed). Requests that come meanwhile wait in
        :meth:`_drive`, other calls into vLLM in :meth:`_on_loop`."""
        door = self._door
        if door is None:
            return None
        with self._seqs_lock:
            if (self._seqs and not self._vllm_paused) or not door.claim():
                return None
        return door

    def _check_engine(self) -> None:
        llm = self._llm
        if llm is None or getattr(llm, "errored", False):
            raise EngineUnavailable("the vLLM engine failed while its workers received weights; create a new engine")

    async def _to_workers(
        self, manifest: WeightManifest, method: str, *, timeout: float, extra: Mapping[str, Any] | None = None,
        landed: Callable[[], None] | None = None,
    ) -> tuple[list[Any], bool]:
        """One receive of ``manifest`` in every worker: rung through the doorbell while no request
        runs, else vLLM's ``collective_rpc`` of the worker's ``method``; either way the workers get
        the manifest's wire form with ``extra``'s keys beside it. ``landed()`` runs once every worker
        answered ok, before requests may go to vLLM again. Returns the workers' answers and whether
        the doorbell took the receive."""
        llm, wire = self._llm, {**manifest_to_wire(manifest), **(extra or {})}

        def then(answers: list[Any]) -> None:
            if landed is not None and all(isinstance(r, dict) and r.get("ok") for r in answers):
                landed()

        door = self._claim_door(manifest)
        if door is not None:
            results: list[Any] = await door.ring(wire, timeout_s=timeout, check=self._check_engine, then=then)
            self._direct_receives += 1
            return results, True

        async def receive() -> list[Any]:  # on the engine loop: `landed` runs with no hop back first
            answers = await llm.collective_rpc(method, timeout=timeout, args=(wire,))
            then(answers)
            return answers

        return await self._on_loop(receive), False

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        from .worker_ext import raise_worker_error

        # The receive blocks the engine core while buckets arrive; the transports time out per
        # bucket, this bound only catches a worker stuck outside them.
        timeout = manifest.timeout_s * (len(manifest.buckets) + 2)
        start = time.perf_counter()
        results, direct = await self._to_workers(manifest, "roe_receive_weights", timeout=timeout,
                                                 landed=lambda: self._start_label(manifest.version))
        # Where the push's time went (diagnostics()): the RPC round trip as the driver saw it, and
        # each worker's own account (validate, wait, check, apply, total).
        self._last_receive = LastReceive(
            version=manifest.version, rpc_s=round(time.perf_counter() - start, 6), direct=direct,
            workers=[ReceiveTimings.of(r.get("timings") if isinstance(r, dict) else None) for r in results],
        )
        try:
            raise_worker_error(results, f"weight update v{manifest.version}", update=True)
        except WeightsInvalidated as exc:
            self._weights_invalid = f"weight update v{manifest.version} failed midway ({exc})"
            raise

    async def _receive_lora(self, manifest: WeightManifest) -> None:
        """Through the weight-sync transport into the workers, then registered with vLLM
        (:mod:`.lora`)."""
        await self._loras.receive(manifest)

    async def _unload_lora(self, name: str) -> None:
        await self._loras.unload(name)

    async def _close_weight_transfer(self) -> None:
        await self._drop_door()
        if self._llm is not None and not self._closed:
            await self._rpc("roe_close_weight_transfer", timeout=60)

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def health(self) -> bool:
        if self._closed or self._llm is None:
            return False
        return not bool(getattr(self._llm, "errored", False))

    def _extra_info(self) -> dict[str, Any]:
        with self._seqs_lock:
            running = sum(1 for q in self._seqs.values() if q.started and not q.done)
        return {
            # vLLM steps every request it holds unless paused: what bench async's EngineSampler reads
            "running_rows": running,
            "frozen": self._vllm_paused,
            "platform": self.platform,
            "sleep_mode": self.sleep_mode,
            "workers": getattr(self, "_workers", []),
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
            "direct_receive": self.options.direct_receive,
            "direct_receives": self._direct_receives,
        }

    async def _close(self) -> None:
        await asyncio.to_thread(self._shutdown_quietly)
        if self._loras is not None:
            self._loras.close()

    def _shutdown_quietly(self) -> None:
        engine_loop = self._engine_loop
        try:
            if self._llm is not None and engine_loop is not None and not engine_loop.closed:
                llm, self._llm = self._llm, None

                async def stop() -> None:
                    llm.shutdown()

                engine_loop.run(stop(), timeout=120)
        except Exception:
            logger.warning("vLLM shutdown failed", exc_info=True)
        finally:
            if engine_loop is not None:
                engine_loop.close()
            with _SLEEP_MODE_LOCK:
                if self._sleep_registered:
                    _SLEEP_MODE_ENGINES.discard(self)
                    self._sleep_registered = False
