"""``transformers``: the embedded default backend, a real engine on transformers model code.

It runs on the CPU or one GPU, in the caller's process:

- **One worker thread owns the model.** Every generation step, sleep, wake-up and weight apply
  runs on that thread, so the event loop is never blocked and no two of them ever overlap:
  generation never runs while weights are being applied.
- **Continuous batching**: requests join and leave the running batch between any two steps (each
  row keeps its own sampling parameters), up to ``max_batch_rows`` rows; a request that arrives
  while a long one runs is prefilled and stepped with it, and finishes first if it is shorter.
  Requests queued together are prefilled together. A control job (sleep, wake-up, a weight apply,
  an in-place receive) waits until the rows running before it have finished and admits nothing
  queued behind it meanwhile, so outside ``keep`` pauses no ``generate`` completion spans two weight
  versions. A streamed row parked for a slow consumer (see *Async RL*) is not waited for: it may
  continue under the new weights, and its deltas' ``weight_version`` show where it switched.
- **Generation** is a left-padded batch with a ``DynamicCache`` and our own sampler
  (:mod:`.sampling`, :mod:`.generation`), so every :class:`SamplingParams` field is honoured.
  Logprobs (``logprobs``, ``top_logprobs``, ``prompt_logprobs``) are raw: ``log_softmax`` of the
  model's logits, before temperature and the top-k/top-p/min-p masks (vLLM's default).
- **Async RL**: every prompt x sample has its request id on its completion; ``stream`` yields each
  row's new tokens as they are made, and a row whose consumer has not taken
  ``stream_buffer_tokens`` tokens yet is taken out of the batch (with its KV) until it catches up,
  so a slow consumer holds a bounded buffer; ``abort`` ends rows at the next step with what they
  have (``finish_reason="abort"``); ``pause("keep")`` stops stepping (rows keep their state) and
  ``resume`` carries on. After a weight change (a push while paused in ``keep`` mode) the kept
  rows' KV was computed by the old weights: it is dropped and recomputed from prompt + tokens so
  far under the new weights (option ``keep_kv_on_weight_change=True`` keeps the old KV instead);
  the per-token versions of the completion show the switch. ``continue_from`` prefills prompt +
  the earlier tokens and appends (``max_tokens`` counts the new tokens; a stream yields only the
  new tokens). Sleeping drops the kept rows' KV the same way.
- **KV cache**: none is kept between requests (rows carry theirs only while they run), so there
  is no prefix cache to reset and sleeping the ``kv_cache`` tag only returns cached allocator
  memory to the device (and the KV of rows kept by a ``keep`` pause, recomputed on resume).
- **Sleep**: level 1 offloads the weights (to CPU memory on a GPU; on the CPU the parameters'
  storage is detached from the model and kept aside) and restores them on wake-up; level 2
  discards them, and the engine refuses to generate until a complete push arrives.
- **Weights** arrive through the core's :class:`WeightReceiver` over any registered transport the
  device can take (on a GPU, CPU transports land on the host and are copied up).
- **LoRA adapters** (``WeightSync.push_lora``) arrive through the same receiver
  (:func:`~rollout_engines.weights.lora.receive_lora`) and are applied by our own low-rank hooks on
  the linear layers, per row (:mod:`.lora`): one batch may mix adapters and the base model. A
  request takes its adapter's current version when it is admitted and keeps it to the end.
- **Requests fail and end alone.** Text prompts are tokenized and every prompt is checked before
  the job is queued (large ones in a thread of their own, so the worker keeps stepping the other
  requests); each job's rows and sampling state are built on their own before the batch runs, so
  a request that cannot run fails alone; a row's own failure during the batch ends only its
  request. Cancelling the task that awaits ``generate`` removes a queued request, or drops a
  running request's rows at the next step; the rest of the batch carries on.

Options (``EngineConfig.options``): ``attn_implementation`` (default ``"sdpa"``),
``max_batch_rows`` (default 256), ``stream_buffer_tokens`` (default 64: tokens a stream may hold
undelivered per row before the row waits for its consumer), ``keep_kv_on_weight_change`` (default
False: see above), ``num_threads`` (CPU intra-op threads of the engine's worker;
default 1 for models under 50M parameters, else torch's setting), ``weight_apply_mode`` (``"staged"``, the default: an interrupted
update changes nothing; ``"inplace"``: no second copy of the weights, an interrupted update makes
the engine refuse to generate until the next complete push), ``max_lora_rank`` (default 64: the
``lora`` capability; 0 turns LoRA off), ``max_loras`` (default 4: adapters loaded at once).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

import torch

from ...backend_kit import check_continuations, validate_prompts
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
from ...types import (
    Completion,
    Diagnostics,
    EngineConfig,
    GenerateRequest,
    LastReceive,
    PauseMode,
    ReceiveTimings,
    StreamDelta,
    TokenLogprob,
)
from ...weights.lora import install_started, receive_lora, with_install_time
from ...weights.manifest import TensorSpec, TransportSpec, WeightManifest
from ...weights.receiver import StateDictTarget, WeightReceiver
from .generation import Batch, Row, make_rows, run_batch
from .lora import Adapter, LoraLayers

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
class _Stream:
    """The consumer side of a streamed request, woken on its own loop when its rows have news."""

    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # rows' visible/delivered/done

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


@dataclass(eq=False)
class _GenerateJob:
    request: GenerateRequest
    future: concurrent.futures.Future[list[Completion]]
    prompts: list[list[int]] | None = None  # tokenized and checked before the job is queued
    rows: list[Row] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    ids: list[str] = field(default_factory=list)  # one per row, prompt-major
    aborted: set[int] = field(default_factory=set)  # rows to end now (under the engine's lock)
    abort_all: bool = False
    error: BaseException | None = None
    left: int = 0  # rows not finished yet (worker)
    stream: _Stream | None = None

    @property
    def size(self) -> int:
        return self.request.batch_size * self.request.sampling.n


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

    def current(self, name: str) -> torch.Tensor:
        """The parameter's current value (sparse deltas are applied on top of it)."""
        return self.engine._target.current(name)

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
        chat=True,
        logprobs=True,
        n=True,
        stop_strings=True,
        seed=True,
        sleep_levels=(1, 2),
        sleep_tags=("weights", "kv_cache"),
        weights_kept_on_sleep=True,
        pause=True,
        pause_modes=("abort", "wait", "keep"),
        streaming=True,
        abort=True,
        top_logprobs=20,
        prompt_logprobs=True,
        continuation=True,
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
        self.stream_buffer_tokens = max(1, int(options.pop("stream_buffer_tokens", 64)))
        self.keep_kv_on_weight_change = bool(options.pop("keep_kv_on_weight_change", False))
        max_lora_rank = int(options.pop("max_lora_rank", 64))
        max_loras = int(options.pop("max_loras", 4))
        if max_lora_rank < 0 or max_loras < 0:
            raise ValueError("max_lora_rank and max_loras must be >= 0")
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

        self.capabilities = self.capabilities.model_copy(update={
            "transports": _transports_for(self.device),
            "lora": max_lora_rank if max_loras else 0, "max_loras": max_loras if max_lora_rank else 0,
        })
        self._shared_generator = torch.Generator(device=self.device)
        self._shared_generator.manual_seed(config.seed)
        self._target = StateDictTarget(self.hf_model)
        self._lora = LoraLayers(self.hf_model)
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
        self._running: list[_GenerateJob] = []  # the generate jobs taken off the queue, not answered yet
        # Worker state: the running batch; rows waiting to be prefilled (new, or whose KV was
        # dropped); rows out of the batch until their stream's consumer catches up.
        self._batch = Batch(self.device, self.vocab_size)
        self._pending: list[Row] = []
        self._parked: list[Row] = []
        self._kv_version = 0  # the weight version the running rows' KV was computed with
        self._next_key = 0
        self._frozen = False  # pause("keep"): nothing is stepped or admitted
        self._abort_flag = False  # aborts or cancellations for the worker to look at
        self._ids: dict[str, tuple[_GenerateJob, int]] = {}  # running request id -> (job, row)
        self._submitting = 0  # generate/stream calls still tokenizing (event loop only)
        self.stream_buffer_peak = 0  # most undelivered tokens a streamed row ever held

        self._jobs: collections.deque[_GenerateJob | _CallJob | None] = collections.deque()
        self._cv = threading.Condition()
        self._worker = threading.Thread(target=self._work, name="roe-transformers", daemon=True)
        self._worker.start()
        logger.info("transformers engine on %s (%s): %s", self.device, self.dtype, config.model)

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
                while self._idle():
                    self._cv.wait()
                if self._jobs and self._jobs[0] is None:
                    break
                call: _CallJob | None = None
                fresh: list[_GenerateJob] = []
                index = self._runnable_call()
                if index is not None:
                    call = self._jobs[index]  # type: ignore[assignment]
                    del self._jobs[index]
                else:
                    fresh = self._take_jobs()
                sweep, self._abort_flag = self._abort_flag, False
            if call is not None:
                if call.future.set_running_or_notify_cancel():
                    try:
                        call.future.set_result(call.fn())
                    except BaseException as exc:
                        call.future.set_exception(exc)
                continue
            try:
                self._tick(fresh, sweep)
            except BaseException as exc:  # a bug or an interrupt: no request may hang on it
                logger.exception("the transformers engine's worker failed")
                self._fail_all(exc)
        self._fail_all(EngineClosed("engine 'transformers' was closed before this request finished"))

    # -- what the worker may do next (all under self._cv) --
    def _can_step(self) -> bool:
        return self._weights_state == "live" and self._invalid_reason is None

    def _runnable_call(self) -> int | None:
        """Where the control job that may run now is in the queue. One runs once the rows running
        before it have finished (so it never lands in the middle of a completion), or at once while
        paused in ``keep`` mode (the frozen rows wait for it; generate jobs queued ahead of it too)."""
        if not (self._frozen or not self._can_step() or (not self._batch.rows and not self._pending)):
            return None
        for i, job in enumerate(self._jobs):
            if isinstance(job, _CallJob):
                return i
            if job is None or not self._frozen:
                return None
        return None

    def _used(self) -> int:
        return len(self._batch.rows) + len(self._parked)

    def _take_jobs(self) -> list[_GenerateJob]:
        """Generate jobs from the head of the queue while there is room (not past a control job)."""
        taken: list[_GenerateJob] = []
        used = self._used() + len(self._pending)
        while not self._frozen and self._jobs and isinstance(self._jobs[0], _GenerateJob) \
                and used < self.max_batch_rows:
            job = self._jobs.popleft()
            assert isinstance(job, _GenerateJob)
            if not job.future.set_running_or_notify_cancel():  # cancelled just before _cancel could remove it
                self.requests_cancelled += 1
                self._forget_ids(job)
                continue
            self._running.append(job)
            taken.append(job)
            used += job.size
        return taken

    def _unparkable(self, row: Row) -> bool:
        return row.visible - row.delivered <= self.stream_buffer_tokens // 2

    def _idle(self) -> bool:
        if self._jobs:
            head = self._jobs[0]
            if head is None or self._runnable_call() is not None:
                return False
            if isinstance(head, _GenerateJob) and not self._frozen and self._used() + len(self._pending) < self.max_batch_rows:
                return False
        if self._abort_flag or self._model_version != self._kv_version:
            return False
        if self._frozen or not self._can_step():
            return True
        if self._batch.rows or (self._pending and self._used() < self.max_batch_rows):
            return False
        return not any(self._unparkable(r) for r in self._parked)

    # -- one round of the worker: admit, end, step --
    def _tick(self, fresh: list[_GenerateJob], sweep: bool) -> None:
        for job in fresh:  # each job's rows and sampling state on their own: a job that cannot run fails alone
            try:
                self._check_worker_state()
                rows = self._rows(job, first_key=self._next_key)
            except BaseException as exc:
                self._resolve(job, error=exc)
                continue
            self._next_key += job.request.batch_size
            for row in rows:
                row.owner = job
            job.rows, job.left = rows, len(rows)
            self._pending.extend(rows)
        if sweep or fresh:
            self._sweep()
        if self._model_version != self._kv_version:
            # The weights changed under kept rows: their KV (and next-token logits) are stale.
            self._kv_version = self._model_version
            if not self.keep_kv_on_weight_change:
                self._drop_kv()
        self._unpark()
        if self._lora.hooked and not self._lora.adapters and not self._rows_hold_adapters():
            self._lora.detach_all()  # every adapter was unloaded and its last rows finished
        if self._frozen or not self._can_step():
            return
        self._admit()
        if not self._batch.rows:
            return
        try:
            finished = self._batch.step(self.hf_model, self.tokenizer, self._shared_generator, self._model_version,
                                        lora=self._lora)
        except Exception as exc:  # the whole step failed: not attributable to one request
            logger.exception("a generation step failed")
            jobs = list(dict.fromkeys(r.owner for r in self._batch.rows))
            self._batch.clear()
            for job in jobs:
                self._fail(job, exc)
            return
        self._publish(self._batch.rows + finished)
        for row in finished:
            self._row_done(row)
        self._park()

    def _rows_hold_adapters(self) -> bool:
        return any(r.lora is not None for r in (*self._batch.rows, *self._pending, *self._parked))

    def _admit(self) -> None:
        """Prefill pending rows into the running batch, as many as there is room for."""
        room = self.max_batch_rows - self._used()
        if room <= 0 or not self._pending:
            return
        rows, self._pending = self._pending[:room], self._pending[room:]
        try:
            self._prefill(rows)
            return
        except Exception as exc:
            jobs = list(dict.fromkeys(r.owner for r in rows))
            if len(jobs) == 1:
                logger.exception("generation failed")
                self._fail(jobs[0], exc)
                return
            # Not attributable to one request: prefill each alone, so that only the one that fails fails.
            logger.warning("prefilling %d requests together failed (%r); trying them one by one", len(jobs), exc)
        for job in jobs:
            try:
                self._prefill([r for r in rows if r.owner is job])
            except Exception as exc:
                logger.exception("generation failed")
                self._fail(job, exc)

    def _prefill(self, rows: list[Row]) -> None:
        self._lora.attach(r.lora for r in rows)
        run_batch(self.hf_model, self.tokenizer, rows, batch=self._batch, pad_id=self.pad_id,
                  version=self._model_version, lora=self._lora)
        if any(r.prefills == 0 for r in rows):
            self.batches_run += 1  # a group of new requests joined the running batch
        for r in rows:
            r.prefills += 1

    def _drop_kv(self) -> None:
        """Forget the KV of every running row; each is prefilled again (prompt + tokens so far)."""
        rows = list(self._batch.rows)
        self._batch.clear()
        for row in self._parked:
            row.parked = None  # prefilled again once its consumer caught up
        self._pending[:0] = rows

    def _park(self) -> None:
        """Take streamed rows whose consumer is ``stream_buffer_tokens`` behind out of the batch."""
        full = [i for i, r in enumerate(self._batch.rows)
                if r.owner.stream is not None and r.visible - r.delivered >= self.stream_buffer_tokens]
        if not full:
            return
        rows = [self._batch.rows[i] for i in full]
        for row, alone in zip(rows, self._batch.split(full), strict=True):
            row.parked = alone
            self._parked.append(row)

    def _unpark(self) -> None:
        ready = [r for r in self._parked if self._unparkable(r)]
        if not ready:
            return
        self._parked = [r for r in self._parked if not self._unparkable(r) or r not in ready]
        back = [r.parked for r in ready if r.parked is not None]
        self._pending[:0] = [r for r in ready if r.parked is None]
        for r in ready:
            r.parked = None
        self._batch.extend(back)  # type: ignore[arg-type]

    def _publish(self, rows: list[Row]) -> None:
        """Make streamed rows' new tokens (and ends) visible to their consumers, and wake them."""
        jobs: dict[_GenerateJob, list[Row]] = {}
        for row in rows:
            if row.owner.stream is not None:
                jobs.setdefault(row.owner, []).append(row)
        for job, mine in jobs.items():
            assert job.stream is not None
            with job.stream.lock:
                for row in mine:
                    row.visible, row.done = len(row.tokens), row.finish is not None
                    self.stream_buffer_peak = max(self.stream_buffer_peak, row.visible - row.delivered)
            job.stream.wake()

    def _sweep(self) -> None:
        """End the rows that were aborted, or whose request was cancelled or failed."""
        with self._cv:
            marks = {job: (job.abort_all, set(job.aborted)) for job in self._running}

        def ends(row: Row) -> bool:
            job = row.owner
            if job.error is not None or job.cancel.is_set():
                return True
            everything, ids = marks.get(job, (False, set()))
            return everything or row.index in ids

        for row in self._take_rows(ends):
            if row.finish is None:
                row.finish = "abort"
            self._publish([row])
            self._row_done(row)

    def _take_rows(self, which: Callable[[Row], bool]) -> list[Row]:
        """Remove the rows ``which`` picks from the batch, the parked and the pending rows."""
        out = [r for r in self._batch.rows if which(r)]
        if out:
            self._batch.keep([i for i, r in enumerate(self._batch.rows) if not which(r)])
        for name in ("_parked", "_pending"):
            rows: list[Row] = getattr(self, name)
            gone = [r for r in rows if which(r)]
            if gone:
                setattr(self, name, [r for r in rows if not which(r)])
                for r in gone:
                    r.parked = None
                out += gone
        return out

    def _row_done(self, row: Row) -> None:
        job: _GenerateJob = row.owner
        if job.future.done():
            return
        if row.error is not None:
            self._fail(job, row.error)
            return
        job.left -= 1
        if job.left <= 0:
            self._finish(job)

    def _fail(self, job: _GenerateJob, error: BaseException) -> None:
        """A request fails as a whole: its other rows stop too."""
        job.error = error
        self._take_rows(lambda r: r.owner is job)
        self._resolve(job, error=error)

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            jobs = list(self._running)
        self._batch.clear()
        self._pending, self._parked = [], []
        for job in jobs:
            if not job.future.done():
                job.error = error
                self._resolve(job, error=error)

    def _finish(self, job: _GenerateJob) -> None:
        """Resolve one job's future from its rows: its result, its own error, or cancelled."""
        rows = job.rows or []
        if job.cancel.is_set():
            with self._cv:
                self.requests_cancelled += 1
            self._resolve(job, error=concurrent.futures.CancelledError())
            return
        error = job.error or next((r.error for r in rows if r.error is not None), None)
        if error is not None:
            self._resolve(job, error=error)
            return
        try:
            completions = [] if job.stream is not None else \
                [r.completion(self.tokenizer, self._model_version) for r in rows]
        except Exception as exc:
            self._resolve(job, error=exc)
            return
        with self._cv:
            self.requests_run += 1
        self._resolve(job, completions)

    def _forget_ids(self, job: _GenerateJob) -> None:
        for rid in job.ids:
            if self._ids.get(rid, (None,))[0] is job:
                del self._ids[rid]

    def _resolve(self, job: _GenerateJob, result: list[Completion] | None = None,
                 error: BaseException | None = None) -> None:
        """Answer one job; it leaves the running batch first, so a caller who sees the answer
        never sees the job as running."""
        with self._cv:
            self._running = [j for j in self._running if j is not job]
            self._forget_ids(job)
        if job.future.done():
            return
        if error is not None:
            job.error = job.error or error
            job.future.set_exception(error)
        else:
            job.future.set_result(result or [])
        if job.stream is not None:
            job.stream.wake()

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
        """Every prompt's token ids, checked against the vocabulary and the context window (with
        the tokens of the completion it continues, if any)."""
        prompts = self._tokenize(request)
        priors = request.continue_from
        validate_prompts(prompts, max_tokens=request.sampling.max_tokens, max_model_len=self.max_model_len,
                         vocab_size=self.vocab_size,
                         continued=[c.token_ids for c in priors] if priors is not None else None)
        check_continuations(request)
        return prompts

    def _rows(self, job: _GenerateJob, first_key: int) -> list[Row]:
        request = job.request
        prompts = job.prompts if job.prompts is not None else self._prompt_ids(request)
        return make_rows(
            prompts, request.sampling, eos_ids=self.eos_ids, max_len=self.max_model_len, device=self.device,
            first_key=first_key, vocab=self.vocab_size, cancel=job.cancel,
            request_ids=job.ids or request.sequence_ids(), priors=request.continue_from,
            lora=self._adapter(request.lora),
        )

    def _adapter(self, name: str | None) -> Adapter | None:
        """The current version of adapter ``name`` (taken once per request, when it is admitted)."""
        if name is None:
            return None
        adapter = self._lora.adapters.get(name)
        if adapter is None:
            raise InvalidRequest(f"LoRA adapter '{name}' was unloaded before this request ran; push it again")
        return adapter

    async def _start(self, request: GenerateRequest, stream: _Stream | None = None) -> _GenerateJob:
        """Tokenize and check a request, then queue it. Here, not on the worker: a large prompt
        must not hold up other requests."""
        self._submitting += 1
        try:
            if request.prompt_token_ids is not None:
                inline = sum(len(p) for p in request.prompt_token_ids) <= _INLINE_CHECK_TOKENS
            elif request.prompts is not None:
                inline = sum(len(p) for p in request.prompts) <= _INLINE_TOKENIZE_CHARS
            else:
                assert request.messages is not None
                inline = sum(len(m.content) for chat in request.messages for m in chat) <= _INLINE_TOKENIZE_CHARS
            prompts = self._prompt_ids(request) if inline else await asyncio.to_thread(self._prompt_ids, request)
            future: concurrent.futures.Future[list[Completion]] = concurrent.futures.Future()
            job = _GenerateJob(request, future, prompts=prompts, ids=request.sequence_ids(), stream=stream)
            self._enqueue(job)
            return job
        finally:
            self._submitting -= 1

    def _enqueue(self, job: _GenerateJob) -> None:
        with self._cv:
            if self._closed:
                raise EngineClosed("engine 'transformers' is closed; create a new one")
            taken = next((rid for rid in job.ids if rid in self._ids), None)
            if taken is not None:
                raise InvalidRequest(
                    f"request id {taken!r} belongs to a request that is still running; request ids must be "
                    "unique among running requests"
                )
            for index, rid in enumerate(job.ids):
                self._ids[rid] = (job, index)
            self._jobs.append(job)
            self._cv.notify()

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        job = await self._start(request)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self._cancel(job)
            raise

    async def _stream(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        """Each row's new tokens as the worker makes them. The worker publishes a row's tokens after
        every step and takes the row out of the batch while ``stream_buffer_tokens`` of them are
        undelivered, so this buffer is bounded however slowly the caller consumes."""
        stream = _Stream(asyncio.get_running_loop())
        job = await self._start(request, stream)
        finished = False
        try:
            while not finished:
                await stream.event.wait()
                stream.event.clear()
                deltas, finished = self._take_deltas(job)
                for delta in deltas:
                    yield delta
        finally:
            if not finished:
                self._cancel(job)

    def _take_deltas(self, job: _GenerateJob) -> tuple[list[StreamDelta], bool]:
        """What the consumer has not seen yet; True once every row's last delta is in the list."""
        future = job.future
        if future.done() and not future.cancelled() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
        rows = job.rows
        if rows is None:
            return [], False
        stream = job.stream
        assert stream is not None
        deltas = []
        with stream.lock:
            for row in rows:
                a, b = row.delivered, row.visible
                final = row.done and not row.final_sent
                if b <= a and not final:
                    continue
                versions = row.versions
                deltas.append(StreamDelta(
                    request_id=row.request_id, prompt_index=row.prompt_index, sample_index=row.sample_index,
                    token_ids=row.tokens[a:b],
                    logprobs=row.logprobs[a:b] if row.params.logprobs is not None else None,
                    top_logprobs=[[TokenLogprob(token_id=i, logprob=lp) for i, lp in entry] for entry in row.top[a:b]]
                    if row.top is not None else None,
                    weight_version=versions[b - 1] if b else (row.all_versions() or [self._model_version])[-1],
                    finish_reason=row.finish if final else None,
                    lora=row.lora.name if row.lora is not None else None,
                    lora_version=row.lora.version if row.lora is not None else None,
                ))
                row.delivered = b
                row.final_sent = row.final_sent or final
            finished = all(r.final_sent for r in rows)
        if self._parked:  # a row waiting for this consumer may go on now
            with self._cv:
                self._cv.notify()
        return deltas, finished

    def _cancel(self, job: _GenerateJob) -> None:
        """Stop a job whose caller went away: out of the queue, or its rows dropped at the next step."""
        job.cancel.set()
        with self._cv:
            self._abort_flag = True
            self._cv.notify()
            try:
                self._jobs.remove(job)
            except ValueError:
                return  # running (its rows end at the next step) or finished already
            self.requests_cancelled += 1
            self._forget_ids(job)
        job.future.cancel()

    # ---- abort and pause -------------------------------------------------------------------------
    async def _abort(self, request_ids: Sequence[str] | None) -> None:
        unstarted: list[_GenerateJob] = []
        with self._cv:
            if request_ids is None:
                touched = [j for j in self._jobs if isinstance(j, _GenerateJob)] + list(self._running)
                for job in touched:
                    job.abort_all = True
            else:
                touched = []
                for rid in request_ids:
                    hit = self._ids.get(rid)
                    if hit is not None:
                        hit[0].aborted.add(hit[1])
                        touched.append(hit[0])
            for job in dict.fromkeys(touched):
                if (job.abort_all or len(job.aborted) >= job.size) and job in self._jobs:
                    self._jobs.remove(job)  # never started: answered here
                    unstarted.append(job)
            self._abort_flag = True
            self._cv.notify()
        for job in unstarted:
            self._end_unstarted(job)

    def _end_unstarted(self, job: _GenerateJob) -> None:
        """Answer a queued request that was aborted as a whole: no new tokens, ``finish_reason="abort"``."""
        if not job.future.set_running_or_notify_cancel():
            with self._cv:
                self._forget_ids(job)
            return
        try:
            rows = self._rows(job, first_key=0)
        except BaseException as exc:
            self._resolve(job, error=exc)
            return
        for row in rows:
            row.owner, row.finish, row.done = job, "abort", True
        job.rows = rows
        self._finish(job)

    async def _pause(self, mode: PauseMode) -> None:
        with self._cv:
            self._frozen = mode == "keep"
            self._cv.notify()
        if mode == "keep":
            # Returns at a step boundary: from here on nothing is stepped or admitted until resume().
            await self._call(lambda: None)
            return
        if mode == "abort":
            await self._abort(None)
        await self._drained()

    async def _drained(self) -> None:
        """Until no request is queued, running or being tokenized."""
        while True:
            with self._cv:
                busy = self._submitting or self._running or any(isinstance(j, _GenerateJob) for j in self._jobs)
            if not busy:
                return
            await asyncio.sleep(0.005)

    async def _resume(self) -> None:
        with self._cv:
            self._frozen = False
            self._cv.notify()

    # ---- sleep -----------------------------------------------------------------------------------
    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        await self._call(lambda: self._sleep_sync(level, tags))

    def _sleep_sync(self, level: int, tags: Sequence[str]) -> None:
        # Rows kept by a keep pause (or waiting for a stream's consumer) give their KV back too;
        # they are prefilled again when they go on.
        self._drop_kv()
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
        self._last_receive = LastReceive(version=manifest.version, workers=[ReceiveTimings.of(receiver.last_timings)])

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

    async def _receive_lora(self, manifest: WeightManifest) -> None:
        receiver = self._receiver
        if receiver is None:
            raise WeightSyncError(
                "engine 'transformers' has no weight transfer open; connect one with connect_weight_sync()"
            )
        spec = manifest.lora
        assert spec is not None

        def receive() -> tuple[Adapter, dict[str, float]]:
            with self._receive_lock:
                tensors = receive_lora(receiver, manifest, self._lora.base_specs())
                timings = receiver.last_timings
            started = install_started()
            adapter = self._lora.build(spec.name, manifest.version, spec.scaling, tensors)
            return adapter, with_install_time(timings, started)

        adapter, timings = await run_in_thread(receive, name="roe-lora-receive")
        with self._cv:  # requests admitted from the next step on get this version
            self._lora.adapters[spec.name] = adapter
        self._last_receive = LastReceive(version=manifest.version, workers=[ReceiveTimings.of(timings)])

    async def _unload_lora(self, name: str) -> None:
        with self._cv:  # rows running with it finish with it; its hooks go once none is left
            self._lora.adapters.pop(name, None)
            self._cv.notify()

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
    async def _diagnostics(self, fingerprint: bool) -> Diagnostics:
        base = await super()._diagnostics(fingerprint)
        return base.model_copy(update={"platform": self.device.type,
                                       "weights_dtype": str(self.dtype).removeprefix("torch.")})

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
            "running_rows": len(self._batch.rows),
            "pending_rows": len(self._pending),
            "parked_rows": len(self._parked),
            "frozen": self._frozen,
            "stream_buffer_peak": self.stream_buffer_peak,
            "requests_cancelled": self.requests_cancelled,
        }

    async def _close(self) -> None:
        with self._cv:
            pending = [j for j in self._jobs if j is not None]
            self._jobs.clear()
            self._jobs.append(None)
            self._cv.notify()
        for job in pending:
            closed = EngineClosed("engine 'transformers' was closed before this request ran")
            if isinstance(job, _GenerateJob):
                if job.future.set_running_or_notify_cancel():
                    self._resolve(job, error=closed)  # wakes its stream's consumer too
                else:
                    with self._cv:
                        self._forget_ids(job)
            elif job.future.set_running_or_notify_cancel():
                job.future.set_exception(closed)
        await asyncio.to_thread(self._worker.join)
        await self._close_weight_transfer()
        self._offloaded.clear()
        self._params.clear()
        self.hf_model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
