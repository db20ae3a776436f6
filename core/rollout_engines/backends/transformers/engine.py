"""``transformers``: the embedded default backend, a real engine on transformers model code.

It runs on the CPU or one GPU, in the caller's process:

- **One worker thread owns the model.** Every generate, sleep, wake-up and weight update is a job
  on that thread's queue, so the event loop is never blocked and no two of them ever overlap:
  generation never runs while weights are being applied. Generate jobs waiting in the queue are
  merged into one batch (each row keeps its own sampling parameters), up to ``max_batch_rows``.
- **Generation** is a left-padded batch with a ``DynamicCache`` and our own sampler
  (:mod:`.sampling`, :mod:`.generation`), so every :class:`SamplingParams` field is honoured.
- **KV cache**: none is kept between requests (each batch builds its own and drops it), so there
  is no prefix cache to reset and sleeping the ``kv_cache`` tag only returns cached allocator
  memory to the device.
- **Sleep**: level 1 offloads the weights (to CPU memory on a GPU; on the CPU the parameters'
  storage is detached from the model and kept aside) and restores them on wake-up; level 2
  discards them, and the engine refuses to generate until a complete push arrives.
- **Weights** arrive through the core's :class:`WeightReceiver` over any registered transport the
  device can take (on a GPU, CPU transports land on the host and are copied up).
- **Requests fail and end alone.** Text prompts are tokenized and every prompt is checked before
  the job is queued (large ones in a thread of their own, so the worker keeps stepping the other
  requests); each job's rows and sampling state are built on their own before the batch runs, so
  a request that cannot run fails alone; a row's own failure during the batch ends only its
  request. Cancelling the task that awaits ``generate`` removes a queued request, or drops a
  running request's rows at the next step; the rest of the batch carries on.

Options (``EngineConfig.options``): ``attn_implementation`` (default ``"sdpa"``),
``max_batch_rows`` (default 256), ``num_threads`` (CPU intra-op threads of the engine's worker;
default 1 for models under 50M parameters, else torch's setting), ``weight_apply_mode`` (``"staged"``, the default: an interrupted
update changes nothing; ``"inplace"``: no second copy of the weights, an interrupted update makes
the engine refuse to generate until the next complete push).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

import torch

from ...engine import Capabilities, Engine
from ...errors import (
    EngineAsleep,
    EngineClosed,
    InvalidRequest,
    ManifestMismatch,
    WeightsInvalidated,
    WeightSyncError,
)
from ...threads import run_in_thread
from ...tokenization import chat_token_ids
from ...types import Completion, EngineConfig, GenerateRequest
from ...weights.manifest import TensorSpec, TransportSpec, WeightManifest
from ...weights.receiver import StateDictTarget, WeightReceiver
from .generation import Row, make_rows, run_batch

logger = logging.getLogger("rollout_engines.backends.transformers")

T = TypeVar("T")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_TRANSPORTS = ("inproc", "gloo", "shm", "disk")
_CUDA_TRANSPORTS = ("nccl", "cuda_ipc")
# Text prompts up to this many characters in all are tokenized on the event loop (well under a
# millisecond); larger ones in a thread, so that neither the loop nor the worker waits for them.
_INLINE_TOKENIZE_CHARS = 16_384
# Token prompts up to this many ids in all are checked on the event loop; larger ones in a thread.
_INLINE_CHECK_TOKENS = 65_536


@dataclass(eq=False)
class _GenerateJob:
    request: GenerateRequest
    future: concurrent.futures.Future[list[Completion]]
    prompts: list[list[int]] | None = None  # tokenized and checked before the job is queued
    rows: list[Row] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class _CallJob:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]


class _ApplyOnWorker:
    """The target of a staged update: the receiving thread hands the complete, verified update to
    the model's worker, which applies it and takes the new version in one step (no completion is
    ever tagged with a version its weights do not have)."""

    def __init__(self, engine: TransformersEngine, version: int) -> None:
        self.engine, self.version = engine, version

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        return self.engine._target.expected_specs()

    def apply(self, named: Sequence[tuple[str, torch.Tensor]], *, owned: bool) -> None:
        engine = self.engine

        def swap() -> None:
            engine._target.apply(named, owned=owned)
            engine._model_version = self.version
            engine._invalid_reason = None

        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        engine._submit(_CallJob(swap, future))
        future.result()


class _RejectAllTarget:
    """Stands in for the model while a push is refused as a whole: every name is unknown, so the
    receiver rejects the manifest and drains the stream (the sender and other engines stay in step)."""

    def expected_specs(self) -> Mapping[str, TensorSpec]:
        return {}

    def apply(self, named: Sequence[tuple[str, torch.Tensor]], *, owned: bool) -> None:
        raise AssertionError("nothing is applied from a rejected update")


def _pick_device(config: EngineConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _transports_for(device: torch.device) -> tuple[str, ...]:
    """Every registered transport whose receiver can land on this device (CPU always: buckets that
    land on the host are copied to the GPU by the target)."""
    from ...plugins import get_registry

    wanted = {"cpu"} | ({device.type} if device.type != "cpu" else set())
    names = list(_CPU_TRANSPORTS) + (list(_CUDA_TRANSPORTS) if device.type == "cuda" else [])
    try:
        for name, entries in get_registry().transports.items():
            if name not in names and wanted & set(entries[0].devices):
                names.append(name)
    except Exception:  # a broken registry must not stop the embedded engine from starting
        logger.debug("could not list registered transports", exc_info=True)
    return tuple(names)


class TransformersEngine(Engine):
    """The embedded engine: transformers model code on the CPU or one GPU, in this process."""

    backend_name: ClassVar[str] = "transformers"
    capabilities = Capabilities(
        sleep_levels=(1, 2),
        sleep_tags=("weights", "kv_cache"),
        weights_kept_on_sleep=True,
        pause=True,
        prefix_cache=False,
        transports=_CPU_TRANSPORTS,
    )

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = _pick_device(config)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device '{self.device}' was asked for but CUDA is not available; use device='cpu'")
        options = dict(config.options)
        self.max_batch_rows = int(options.pop("max_batch_rows", 256))
        apply_mode = options.pop("weight_apply_mode", "staged")
        if apply_mode not in ("staged", "inplace"):
            raise ValueError(f"weight_apply_mode must be 'staged' or 'inplace', not {apply_mode!r}")
        self._apply_mode: Literal["staged", "inplace"] = apply_mode
        attn = options.pop("attn_implementation", "sdpa")
        threads = options.pop("num_threads", None)
        if options:
            logger.warning("transformers engine: ignoring unknown options %s", sorted(options))

        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        dtype: Any = _DTYPES.get(config.dtype, "auto")
        # transformers renamed torch_dtype to dtype in 4.56; the core supports older releases too.
        dtype_kw = "dtype" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56) else "torch_dtype"
        model: Any = AutoModelForCausalLM.from_pretrained(config.model, attn_implementation=attn, **{dtype_kw: dtype})
        self.hf_model = model.to(self.device).eval()
        self.dtype = next(self.hf_model.parameters()).dtype
        window: Any = config.max_model_len or getattr(self.hf_model.config, "max_position_embeddings", None)
        self.max_model_len = int(window or 2048)
        self.vocab_size = int(self.hf_model.get_input_embeddings().weight.shape[0])
        self.pad_id = self._pad_id()
        n_params = sum(p.numel() for p in self.hf_model.parameters())
        # Intra-op threads are set per OS thread, so this touches only the engine's worker. A tiny
        # model's ops are too small to split: extra threads only spin (10x slower on a busy host).
        self.num_threads = int(threads) if threads is not None else (1 if n_params < 50_000_000 else None)
        self.eos_ids = self._eos_ids()

        self.capabilities = self.capabilities.model_copy(update={"transports": _transports_for(self.device)})
        self._shared_generator = torch.Generator(device=self.device)
        self._shared_generator.manual_seed(config.seed)
        self._target = StateDictTarget(self.hf_model)
        self._receive_lock = threading.Lock()  # one receive at a time; close waits for it
        self._receiver: WeightReceiver | None = None
        # Unique parameters (tied weights appear once), by their first name.
        self._params: dict[str, torch.nn.Parameter] = dict(self.hf_model.named_parameters())
        self._shapes = {n: (tuple(p.shape), p.dtype) for n, p in self._params.items()}
        self._offloaded: dict[str, torch.Tensor] = {}
        # State owned by the worker thread (checked again there: the event loop's checks can be
        # overtaken by a sleep or a failed update queued just before a generate).
        self._weights_state: Literal["live", "offloaded", "discarded"] = "live"
        self._invalid_reason: str | None = None
        self._model_version = 0
        self.batches_run = 0  # batches and requests generated so far (requests / batches: merging)
        self.requests_run = 0
        self.requests_cancelled = 0  # requests cancelled while queued or running
        self._running: list[_GenerateJob] = []  # the generate jobs of the batch now running

        self._jobs: collections.deque[_GenerateJob | _CallJob | None] = collections.deque()
        self._cv = threading.Condition()
        self._worker = threading.Thread(target=self._work, name="roe-transformers", daemon=True)
        self._worker.start()
        logger.info("transformers engine on %s (%s): %s", self.device, self.dtype, config.model)

    @staticmethod
    def generate_benchmark(args: Any) -> dict[str, Any]:
        """``rollout-engines bench generate``: this engine against ``model.generate`` (see :mod:`.bench`)."""
        from .bench import generate_benchmark

        return generate_benchmark(args)

    # ---- model facts -----------------------------------------------------------------------------
    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(self.hf_model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, list | tuple) else [gen_eos]))
        return frozenset(ids)

    def _pad_id(self) -> int:
        for candidate in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0):
            if candidate is not None:
                return int(candidate)
        return 0

    # ---- the worker thread -----------------------------------------------------------------------
    def _submit(self, job: _GenerateJob | _CallJob) -> None:
        with self._cv:
            if self._closed and job is not None:
                job.future.set_exception(EngineClosed("engine 'transformers' is closed; create a new one"))
                return
            self._jobs.append(job)
            self._cv.notify()

    async def _call(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(_CallJob(fn, future))
        return await asyncio.wrap_future(future)

    def _work(self) -> None:
        if self.num_threads and self.device.type == "cpu":
            torch.set_num_threads(self.num_threads)
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job = self._jobs.popleft()
                if job is None:
                    return
                batch: list[_GenerateJob] = []
                if isinstance(job, _GenerateJob):
                    batch.append(job)
                    rows = job.request.batch_size * job.request.sampling.n
                    # Merge the generate jobs queued right behind this one (not past a control job).
                    while self._jobs and isinstance(self._jobs[0], _GenerateJob):
                        nxt = self._jobs[0]
                        assert nxt is not None
                        more = nxt.request.batch_size * nxt.request.sampling.n
                        if rows + more > self.max_batch_rows:
                            break
                        batch.append(self._jobs.popleft())  # type: ignore[arg-type]
                        rows += more
            if isinstance(job, _CallJob):
                if job.future.set_running_or_notify_cancel():
                    try:
                        job.future.set_result(job.fn())
                    except BaseException as exc:
                        job.future.set_exception(exc)
            else:
                live = [j for j in batch if j.future.set_running_or_notify_cancel()]
                if len(live) < len(batch):  # cancelled while queued, just before _cancel could remove them
                    with self._cv:
                        self.requests_cancelled += len(batch) - len(live)
                self._run_generate(live)

    def _run_generate(self, jobs: list[_GenerateJob]) -> None:
        ready: list[_GenerateJob] = []
        first_key = 0
        for job in jobs:
            try:  # each job's rows and sampling state on their own: a job that cannot run fails alone
                self._check_worker_state()
                job.rows = self._rows(job, first_key=first_key)
                first_key += job.request.batch_size
                ready.append(job)
            except BaseException as exc:
                job.future.set_exception(exc)
        if not ready:
            return
        self._running = ready
        try:
            self._run_jobs(ready)
        finally:
            self._running = []

    def _run_jobs(self, ready: list[_GenerateJob]) -> None:
        try:
            self._run_rows([r for job in ready for r in job.rows or ()])
        except Exception as exc:
            if len(ready) == 1:
                logger.exception("generation failed")
                self._resolve(ready[0], error=exc)
                return
            # Not attributable to one request: run each alone, so that only the one that fails fails.
            logger.warning("a merged batch of %d requests failed (%r); running them one by one", len(ready), exc)
            for job in ready:
                self._run_jobs_alone(job)
            return
        except BaseException as exc:
            logger.exception("generation failed")
            for job in ready:
                self._resolve(job, error=exc)
            return
        self.batches_run += 1
        for job in ready:
            self._finish(job)

    def _run_jobs_alone(self, job: _GenerateJob) -> None:
        try:
            job.rows = self._rows(job, first_key=0)  # fresh rows (and seeded generators)
            self._run_rows(job.rows)
        except Exception as exc:
            logger.exception("generation failed")
            self._resolve(job, error=exc)
            return
        self.batches_run += 1
        self._finish(job)

    def _run_rows(self, rows: list[Row]) -> None:
        # A request larger than max_batch_rows runs in slices, which bounds activation and KV memory.
        for start in range(0, len(rows), self.max_batch_rows):
            part = rows[start:start + self.max_batch_rows]
            for row in part:
                if row.cancel is not None and row.cancel.is_set():
                    row.finish = "abort"
            part = [r for r in part if r.finish is None]
            if part:
                run_batch(self.hf_model, self.tokenizer, part, device=self.device, pad_id=self.pad_id,
                          shared=self._shared_generator)

    def _finish(self, job: _GenerateJob) -> None:
        """Resolve one job's future from its rows: its result, its own error, or cancelled."""
        rows = job.rows or []
        if job.cancel.is_set():
            with self._cv:
                self.requests_cancelled += 1
            self._resolve(job, error=concurrent.futures.CancelledError())
            return
        error = next((r.error for r in rows if r.error is not None), None)
        if error is not None:
            self._resolve(job, error=error)
            return
        try:
            completions = [r.completion(self.tokenizer, self._model_version) for r in rows]
        except Exception as exc:
            self._resolve(job, error=exc)
            return
        self.requests_run += 1
        self._resolve(job, completions)

    def _resolve(self, job: _GenerateJob, result: list[Completion] | None = None,
                 error: BaseException | None = None) -> None:
        """Answer one job; it leaves the running batch first, so a caller who sees the answer
        never sees the job as running."""
        with self._cv:
            self._running = [j for j in self._running if j is not job]
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result or [])

    def _check_worker_state(self) -> None:
        if self._weights_state != "live":
            raise EngineAsleep("engine 'transformers' has released its weights; call wake_up() first")
        if self._invalid_reason:
            raise WeightsInvalidated(
                f"engine 'transformers' refuses to generate: {self._invalid_reason}. "
                "Push a complete set of weights (WeightSync.push) to continue"
            )

    # ---- requests --------------------------------------------------------------------------------
    def _tokenize(self, request: GenerateRequest) -> list[list[int]]:
        if request.prompt_token_ids is not None:
            return [list(p) for p in request.prompt_token_ids]
        if request.prompts is not None:
            return [list(self.tokenizer(p, add_special_tokens=True)["input_ids"]) for p in request.prompts]
        assert request.messages is not None
        return [chat_token_ids(self.tokenizer, chat) for chat in request.messages]

    def _prompt_ids(self, request: GenerateRequest) -> list[list[int]]:
        """Every prompt's token ids, checked against the vocabulary and the context window."""
        prompts = self._tokenize(request)
        for i, p in enumerate(prompts):
            if not p:
                raise InvalidRequest(f"prompt {i} is empty after tokenization; give at least one token of text")
            bad = next((t for t in p if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"prompt {i} has token id {bad} outside the model's vocabulary (size {self.vocab_size})"
                )
            if len(p) >= self.max_model_len:
                raise InvalidRequest(
                    f"prompt {i} has {len(p)} tokens; the context window is {self.max_model_len} "
                    "(max_model_len), which leaves no room to generate. Shorten the prompt"
                )
        return prompts

    def _rows(self, job: _GenerateJob, first_key: int) -> list[Row]:
        request = job.request
        prompts = job.prompts if job.prompts is not None else self._prompt_ids(request)
        return make_rows(
            prompts, request.sampling, eos_ids=self.eos_ids, max_len=self.max_model_len, device=self.device,
            first_key=first_key, vocab=self.vocab_size, cancel=job.cancel,
        )

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        # Tokenize and check here, not on the worker: a large prompt must not hold up other requests.
        if request.prompt_token_ids is not None:
            inline = sum(len(p) for p in request.prompt_token_ids) <= _INLINE_CHECK_TOKENS
        elif request.prompts is not None:
            inline = sum(len(p) for p in request.prompts) <= _INLINE_TOKENIZE_CHARS
        else:
            assert request.messages is not None
            inline = sum(len(m.content) for chat in request.messages for m in chat) <= _INLINE_TOKENIZE_CHARS
        prompts = self._prompt_ids(request) if inline else await asyncio.to_thread(self._prompt_ids, request)
        future: concurrent.futures.Future[list[Completion]] = concurrent.futures.Future()
        job = _GenerateJob(request, future, prompts=prompts)
        self._submit(job)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._cancel(job)
            raise

    def _cancel(self, job: _GenerateJob) -> None:
        """Stop a job whose caller went away: out of the queue, or its rows dropped at the next step."""
        job.cancel.set()
        with self._cv:
            try:
                self._jobs.remove(job)
            except ValueError:
                return  # running (its rows end at the next step) or finished already
            self.requests_cancelled += 1
        job.future.cancel()

    # ---- sleep -----------------------------------------------------------------------------------
    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        await self._call(lambda: self._sleep_sync(level, tags))

    def _sleep_sync(self, level: int, tags: Sequence[str]) -> None:
        if "weights" in tags and self._weights_state == "live":
            with torch.no_grad():
                for name, param in self._params.items():
                    if level == 1:
                        # On the CPU there is nowhere cheaper to put them: keep the storage aside.
                        if self.device.type == "cpu":
                            keep = param.data
                        else:  # pinned host memory: the copies back on wake-up run at full speed
                            keep = torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
                            keep.copy_(param.data, non_blocking=True)
                        self._offloaded[name] = keep
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the host copies are complete before anything reads them
            self._weights_state = "offloaded" if level == 1 else "discarded"
            if level >= 2:
                self._invalid_reason = "weights were discarded by sleep(level=2) and not pushed again since"
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def _wake_up(self, tags: Sequence[str]) -> None:
        await self._call(lambda: self._wake_sync(tags))

    def _wake_sync(self, tags: Sequence[str]) -> None:
        if "weights" not in tags or self._weights_state == "live":
            return
        with torch.no_grad():
            for name, param in self._params.items():
                if self._weights_state == "offloaded":
                    param.data = self._offloaded[name].to(self.device, non_blocking=True)
                else:  # discarded: memory back, values come with the next push
                    shape, dtype = self._shapes[name]
                    param.data = torch.zeros(shape, dtype=dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # pinned sources must outlive their copies
        self._offloaded.clear()
        self._weights_state = "live"

    # ---- weights ---------------------------------------------------------------------------------
    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        from ...plugins import get_registry

        devices = get_registry().transport(spec.transport).devices
        # CPU transports land on the host; the target then copies into GPU parameters.
        device = self.device if self.device.type in devices else torch.device("cpu")
        receiver = WeightReceiver(self._target, device=device, mode=self._apply_mode, label="transformers")
        # A new session replaces the old one: a receive still waiting on the old one gives up now.
        if self._receiver is not None:
            self._receiver.cancel("a new weight-sync session was opened")
        # Connecting may wait for the trainer's rendezvous (bounded by the spec's timeout): on a
        # thread of its own, so neither the model's worker nor the shared executor waits with it.
        await run_in_thread(receiver.connect, spec, name="roe-weights-connect")
        old, self._receiver = self._receiver, receiver
        if old is not None:
            await run_in_thread(self._close_receiver, old, name="roe-weights-close")

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        receiver = self._receiver
        if receiver is None:
            raise WeightSyncError(
                "engine 'transformers' has no weight transfer open; connect one with connect_weight_sync()"
            )
        try:
            if self._apply_mode == "staged":
                # Buckets arrive on a thread of their own while generation goes on; only the final
                # apply runs on the model's worker, between two generation steps.
                await run_in_thread(self._receive_sync, receiver, manifest, name="roe-weights-receive")
            else:  # in place: nothing generates while parameters change bucket by bucket
                await self._call(lambda: self._receive_sync(receiver, manifest))
        except WeightsInvalidated as exc:
            self._weights_invalid = str(exc)
            raise

    def _receive_sync(self, receiver: WeightReceiver, manifest: WeightManifest) -> None:
        with self._receive_lock:
            if self._invalid_reason is not None:
                # The current weights are not a valid model: only a complete update can fix that.
                covered = {t.name for t in manifest.tensors}
                missing = sorted(
                    n for n in self._params if n not in covered and not self._tied_name_covered(n, covered)
                )
                if missing:
                    receiver.target = _RejectAllTarget()
                    try:
                        receiver.receive(manifest)
                    except ManifestMismatch:
                        pass
                    finally:
                        receiver.target = self._target
                    raise ManifestMismatch(
                        f"weight update v{manifest.version} rejected: the engine's weights are invalid "
                        f"({self._invalid_reason}), so it needs a complete push; missing {len(missing)} "
                        f"tensors, e.g. {missing[:3]}"
                    )
            if self._apply_mode == "staged":
                receiver.target = _ApplyOnWorker(self, manifest.version)
                try:
                    receiver.receive(manifest)
                finally:
                    receiver.target = self._target
                return
            try:
                self._model_version = receiver.receive(manifest)
            except WeightsInvalidated as exc:
                self._invalid_reason = str(exc)
                raise
            self._invalid_reason = None

    def _close_receiver(self, receiver: WeightReceiver) -> None:
        """Cancel a receive in progress on ``receiver``, wait until it gave up, then close it."""
        receiver.cancel("the weight-sync session was closed")
        # A cancelled receive raises within a check interval; bounded in any case.
        got = self._receive_lock.acquire(timeout=30.0)
        try:
            receiver.close()
        finally:
            if got:
                self._receive_lock.release()

    def _tied_name_covered(self, name: str, covered: set[str]) -> bool:
        """A tied parameter counts as pushed under any of its names."""
        param = self._params[name]
        return any(other in covered for other, t in self.hf_model.state_dict(keep_vars=True).items() if t is param)

    async def _close_weight_transfer(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            await run_in_thread(self._close_receiver, receiver, name="roe-weights-close")

    # ---- lifecycle -------------------------------------------------------------------------------
    def _extra_info(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_model_len": self.max_model_len,
            "queued": len(self._jobs),
            "weights": self._weights_state,
            "batches_run": self.batches_run,
            "requests_run": self.requests_run,
            "running": len(self._running),
            "requests_cancelled": self.requests_cancelled,
        }

    async def _close(self) -> None:
        with self._cv:
            pending = [j for j in self._jobs if j is not None]
            self._jobs.clear()
            self._jobs.append(None)
            self._cv.notify()
        for job in pending:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(EngineClosed("engine 'transformers' was closed before this request ran"))
        await asyncio.to_thread(self._worker.join)
        await self._close_weight_transfer()
        self._offloaded.clear()
        self._params.clear()
        self.hf_model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
