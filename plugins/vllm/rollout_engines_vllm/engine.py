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
- Weights arrive in every worker through :mod:`.worker_ext`; the driver calls it with
  ``collective_rpc`` as an async task, concurrently with the trainer's send.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from rollout_engines.engine import Capabilities, Engine
from rollout_engines.errors import (
    BackendNotInstalled,
    EngineClosed,
    EngineUnavailable,
    InvalidRequest,
    WeightsInvalidated,
)
from rollout_engines.types import (
    Completion,
    EngineConfig,
    FinishReason,
    GenerateRequest,
    PauseMode,
    SamplingParams,
)
from rollout_engines.weights.manifest import TransportSpec, WeightManifest, manifest_to_wire

from .plugin import CPU_TRANSPORTS, CUDA_TRANSPORTS, INSTALL_HINT

logger = logging.getLogger("rollout_engines.vllm")

T = TypeVar("T")

WORKER_EXTENSION = "rollout_engines_vllm.worker_ext.WorkerExtension"  # vLLM qualname: dots only
CPU_KV_CACHE_BYTES = 256 * 2**20

#: vLLM's sleep mode swaps the CUDA allocator of the process for its own (a process-wide
#: singleton), so a second sleep-mode engine in one process breaks the first (vllm#18975).
_SLEEP_MODE_ENGINES: weakref.WeakSet[VllmEngine] = weakref.WeakSet()
_SLEEP_MODE_LOCK = threading.Lock()


class SleepModeEngineExists(EngineUnavailable):
    """Another sleep-mode vLLM engine is alive in this process; only one can be."""


class VllmOptions(BaseModel):
    """The vLLM backend's own options (``create_engine("vllm", model=..., **options)``).

    Anything not listed here is passed to ``vllm.AsyncEngineArgs`` unchanged (for example
    ``max_num_seqs``, ``gpu_memory_utilization``, ``enable_prefix_caching``).
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
    copy_plan: bool = Field(
        default=True,
        description="CUDA: learn where each tensor lands on the first push, then load later pushes "
        "by direct copies (rollout_engines_vllm.copy_plan) instead of vLLM's per-tensor loaders.",
    )
    pause_mode: Literal["keep", "wait", "abort"] = Field(
        default="keep", description="What pause() does to in-flight requests (vLLM's pause_generation mode)."
    )
    cache_root: str | None = Field(default=None, description="VLLM_CACHE_ROOT (compile caches).")
    hf_offline: bool = Field(default=True, description="HF_HUB_OFFLINE=1 (unless set) when the model is a local directory.")
    log_stats: bool = False


def _filter_kwargs(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``fn`` accepts (vLLM's signatures change between releases)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


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


def _client_errors() -> tuple[type[BaseException], ...]:
    """Exception types vLLM raises for a request that does not fit the model (bad input)."""
    kinds: list[type[BaseException]] = [ValueError]
    try:
        from vllm.exceptions import VLLMClientError

        kinds.append(VLLMClientError)
    except ImportError:  # older vLLM raises ValueError
        pass
    return tuple(kinds)


class VllmEngine(Engine):
    """A vLLM engine. Create it with ``rollout_engines.create_engine("vllm", model=PATH, ...)``."""

    backend_name: ClassVar[str] = "vllm"
    #: Declared for listings; each instance replaces it with its platform's (see _capabilities_for).
    capabilities = Capabilities(transports=CPU_TRANSPORTS, tensor_parallel=True, multi_process=True)

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.options = VllmOptions.model_validate(config.options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._llm: Any = None
        self._sleep_registered = False
        # Requests submitted, and how many had been when the prefix cache was last reset: equal
        # means nothing can be cached, so a reset (O(KV blocks) in vLLM) is skipped.
        self._submitted = 0
        self._submitted_at_reset = -1
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
            sleep_levels=(1, 2) if sleep_mode else (),
            sleep_tags=("weights", "kv_cache") if sleep_mode else (),
            weights_kept_on_sleep=True,  # level 1 offloads them; level 2 is handled by the base class
            transports=CUDA_TRANSPORTS if platform == "cuda" else CPU_TRANSPORTS,
            tensor_parallel=True,
            multi_process=True,
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

    def engine_args(self) -> Any:
        """The ``vllm.AsyncEngineArgs`` this engine starts with."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        cfg, opts = self.config, self.options
        cpu = self.platform == "cpu"
        kwargs: dict[str, Any] = dict(opts.model_extra or {})
        kwargs.update(
            model=cfg.model,
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
        return AsyncEngineArgs(**kwargs)

    def _start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self.engine_args()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="roe-vllm-loop", daemon=True)
        self._thread.start()
        start = time.perf_counter()

        async def make() -> Any:
            # Built inside the engine loop so AsyncLLM's output handler lives there.
            return AsyncLLM.from_engine_args(args)

        self._llm = asyncio.run_coroutine_threadsafe(make(), self._loop).result()
        self._tokenizer = self._llm.get_tokenizer()
        self._workers: list[dict[str, Any]] = self._sync(lambda: self._llm.collective_rpc("roe_worker_info"))
        logger.info(
            "vLLM engine on %s started in %.1f s (%d worker(s), platform %s)", self.config.model,
            time.perf_counter() - start, len(self._workers), self.platform,
        )

    # ---- running coroutines on the engine loop -----------------------------------------------------
    def _sync(self, factory: Callable[[], Awaitable[T]]) -> T:
        assert self._loop is not None

        async def call() -> T:
            return await factory()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    async def _on_loop(self, factory: Callable[[], Awaitable[T]]) -> T:
        """Await ``factory()`` on the engine loop from any caller loop (cancellation propagates)."""
        if self._loop is None or self._loop.is_closed():
            raise EngineClosed("vLLM engine is closed; create a new one")

        async def call() -> T:
            return await factory()

        if asyncio.get_running_loop() is self._loop:
            return await call()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), self._loop))

    # ---- generation ----------------------------------------------------------------------------------
    def _vllm_sampling(self, s: SamplingParams, seed: int | None) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            max_tokens=s.max_tokens,
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None,
            ignore_eos=s.ignore_eos,
            seed=seed,
            logprobs=s.logprobs,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _prompts(self, request: GenerateRequest) -> list[dict[str, Any]]:
        if request.prompt_token_ids is not None:
            return [{"prompt_token_ids": list(ids)} for ids in request.prompt_token_ids]
        if request.prompts is not None:
            return [{"prompt": text} for text in request.prompts]
        assert request.messages is not None
        out = []
        for chat in request.messages:
            text = self._tokenizer.apply_chat_template(
                [m.model_dump() for m in chat], add_generation_prompt=True, tokenize=False
            )
            out.append({"prompt_token_ids": self._tokenizer.encode(text, add_special_tokens=False)})
        return out

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        s = request.sampling
        prompts = self._prompts(request)
        # One seed per prompt, spaced by n: vLLM gives sample k of a request seed + k.
        params = [self._vllm_sampling(s, None if s.seed is None else s.seed + i * s.n) for i in range(len(prompts))]
        batch = uuid.uuid4().hex[:12]
        llm = self._llm
        self._submitted += 1

        async def one(i: int) -> Any:
            final = None
            async for out in llm.generate(prompts[i], params[i], f"roe-{batch}-{i}"):
                final = out
            return final

        async def run() -> list[Any]:
            tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:  # cancelling a vLLM generate() aborts its request
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        try:
            outputs = await self._on_loop(run)
        except _client_errors() as exc:
            raise InvalidRequest(f"vLLM rejected the request: {exc}") from exc
        version = self.weight_version
        return [c for i, out in enumerate(outputs) for c in self._completions(i, out, s, version)]

    @staticmethod
    def _completions(index: int, out: Any, s: SamplingParams, version: int) -> list[Completion]:
        prompt_ids = list(out.prompt_token_ids or [])
        result = []
        for sample in sorted(out.outputs, key=lambda o: o.index):
            ids = list(sample.token_ids)
            logprobs = None
            if s.logprobs is not None and sample.logprobs is not None:
                logprobs = [float(step[tok].logprob) for tok, step in zip(ids, sample.logprobs, strict=False)]
            reason: FinishReason = sample.finish_reason if sample.finish_reason in ("stop", "length") else "abort"
            result.append(
                Completion(
                    prompt_index=index, sample_index=sample.index, prompt_token_ids=prompt_ids, token_ids=ids,
                    text=sample.text, logprobs=logprobs, finish_reason=reason, weight_version=version,
                )
            )
        return result

    # ---- cache, pause, sleep ---------------------------------------------------------------------------
    async def _reset_prefix_cache(self) -> None:
        if "kv_cache" in self._asleep:
            return  # nothing cached while the KV cache is released; wake_up resets it
        submitted = self._submitted
        if submitted == self._submitted_at_reset:
            self.last_reset_s = 0.0  # nothing generated since the last reset: nothing cached
            return
        start = time.perf_counter()
        try:
            if await self._reset_prefix_cache_now():
                self._submitted_at_reset = submitted
        finally:
            self.last_reset_s = round(time.perf_counter() - start, 6)

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
        llm = self._llm
        if not hasattr(llm, "pause_generation"):
            return  # the base class holds new requests; in-flight ones finish
        kwargs = _filter_kwargs(llm.pause_generation, mode=self.options.pause_mode, clear_cache=False)
        await self._on_loop(lambda: llm.pause_generation(**kwargs))

    async def _resume(self) -> None:
        llm = self._llm
        if hasattr(llm, "resume_generation"):
            await self._on_loop(llm.resume_generation)

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

    def weights_dtype(self) -> str:
        """The dtype pushes must carry (the engine's, after ``auto`` was resolved)."""
        return str(self._llm.model_config.dtype).removeprefix("torch.")

    async def weights_fingerprint(self) -> Any:
        """What tells two weight states apart (benchmarks, tests): every worker's parameter sums on
        CUDA; on the CPU, where vLLM repacks linear weights out of their parameters, the greedy
        tokens of a fixed prompt."""
        if self.platform == "cuda":
            return await self._rpc("roe_param_checksum")
        request = GenerateRequest(
            prompt_token_ids=[[11, 12, 13, 14]], sampling=SamplingParams(temperature=0, max_tokens=8)
        )
        return [c.token_ids for c in await self.generate(request)]

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        from .worker_ext import raise_worker_error

        worker_options = {"mode": self.options.weight_apply_mode, "copy_plan": self.options.copy_plan}
        results = await self._rpc(
            "roe_init_weight_transfer", spec.model_dump_json(), worker_options, timeout=spec.timeout_s + 30
        )
        raise_worker_error(results, f"joining the '{spec.transport}' weight sync")

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        from .worker_ext import raise_worker_error

        # The receive blocks the engine core while buckets arrive; the transports time out per
        # bucket, this bound only catches a worker stuck outside them.
        timeout = manifest.timeout_s * (len(manifest.buckets) + 2)
        start = time.perf_counter()
        results = await self._rpc("roe_receive_weights", manifest_to_wire(manifest), timeout=timeout)
        #: Where the last push's time went (benchmarks report it): the RPC round trip as the
        #: driver saw it, and each worker's own account (validate, wait, check, apply, total).
        self.last_receive = {
            "rpc_s": round(time.perf_counter() - start, 6), "workers": [r.get("timings") for r in results],
        }
        try:
            raise_worker_error(results, f"weight update v{manifest.version}", update=True)
        except WeightsInvalidated as exc:
            self._weights_invalid = f"weight update v{manifest.version} failed midway ({exc})"
            raise

    async def _close_weight_transfer(self) -> None:
        if self._llm is not None and not self._closed:
            await self._rpc("roe_close_weight_transfer", timeout=60)

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def health(self) -> bool:
        if self._closed or self._llm is None:
            return False
        return not bool(getattr(self._llm, "errored", False))

    def _extra_info(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "sleep_mode": self.sleep_mode,
            "workers": getattr(self, "_workers", []),
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
        }

    async def _close(self) -> None:
        await asyncio.to_thread(self._shutdown_quietly)

    def _shutdown_quietly(self) -> None:
        try:
            if self._llm is not None and self._loop is not None and not self._loop.is_closed():
                llm, self._llm = self._llm, None

                async def stop() -> None:
                    llm.shutdown()

                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=120)
        except Exception:
            logger.warning("vLLM shutdown failed", exc_info=True)
        finally:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._loop.stop)
                if self._thread is not None:
                    self._thread.join(timeout=30)
                if not self._loop.is_running():
                    self._loop.close()
            with _SLEEP_MODE_LOCK:
                if self._sleep_registered:
                    _SLEEP_MODE_ENGINES.discard(self)
                    self._sleep_registered = False

    # ---- benchmark -------------------------------------------------------------------------------------
    @classmethod
    def generate_benchmark(cls, args: Any) -> dict[str, Any]:
        """The same batch through raw ``AsyncLLM`` and through this engine, in one run.

        ``args`` is the ``rollout-engines bench generate`` namespace or a dict; fields used (all
        optional): ``model``, ``prompts`` (batch size), ``prompt_len``, ``max_tokens``, ``repeats``,
        ``option`` (``K=V`` strings) and ``options`` (a dict of engine options).
        """
        from .bench import run_generate_benchmark

        return run_generate_benchmark(cls, args)
