"""The part of SGLang the engine talks to, behind a small interface.

:class:`SglangRuntime` lists the operations :class:`~.engine.SglangEngine` needs.
:class:`InProcessRuntime` implements them on SGLang's in-process ``sglang.Engine``:

* SGLang's engine lives on an event loop of its own, in a thread of its own (a
  :class:`rollout_engines.backend_kit.LoopThread` named "roe-sglang"). Its tokenizer manager binds
  background tasks to the loop of its first call, so calls arriving from several loops (a
  trainer's, a blocking facade's, a test's) would hang; here they all run on the one loop, and
  callers await them from anywhere.
* Starting it off the main thread also keeps SGLang from installing its signal handlers, which
  kill the whole process tree (the trainer included) when a worker fails; the engine routes that
  signal through :func:`.signals.guard_child_failure_signal` instead.
* The blocking helpers of ``sglang.Engine`` (``flush_cache()``, ``release_memory_occupation()``,
  ...) run ``loop.run_until_complete`` and cannot be used from a running loop; the adapter awaits
  the tokenizer manager's coroutines they wrap instead.
* Start-up is bounded (``start_timeout_s``): ``sglang.Engine`` waits for its schedulers as long as
  they live, so past the limit the processes it started are stopped, which ends that wait, and the
  start fails with :class:`~rollout_engines.errors.EngineUnavailable`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from rollout_engines.backend_kit import LoopThread
from rollout_engines.errors import EngineUnavailable

logger = logging.getLogger("rollout_engines.sglang")

T = TypeVar("T")


#: How long a timed-out start may take to unwind once its processes are stopped.
START_UNWIND_S = 30.0


def _descendants() -> set[int]:
    """This process's descendants (pids)."""
    import psutil

    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def _stop(pids: set[int], grace_s: float = 5.0, *, tree: bool = False, kill_now: bool = False) -> set[int]:
    """SIGTERM ``pids`` (and their descendants: ``tree``), then SIGKILL what is left after
    ``grace_s``; ``kill_now``: SIGKILL at once (what SGLang's shutdown does) and wait up to
    ``grace_s`` until they are gone. Returns those signalled."""
    import psutil

    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs.extend([proc, *proc.children(recursive=True)] if tree else [proc])
        except psutil.NoSuchProcess:
            continue
    alive = procs
    if not kill_now:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)
        _gone, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return {p.pid for p in procs}


#: Held while a shutdown swaps SGLang's ``kill_process_tree`` (one engine's at a time).
_SHUTDOWN_LOCK = threading.Lock()


def shutdown_own_processes(engine: Any, own: set[int], module: Any) -> None:
    """``engine.shutdown()`` (an ``sglang.Engine``), ending only ``own``, the processes it started.

    SGLang's shutdown ends with ``kill_process_tree(os.getpid(), include_parent=False)``: every
    child of the process, so also the schedulers of the other engines it hosts and whatever the
    trainer started itself (data loader workers, another backend's workers). While it runs,
    ``module.kill_process_tree`` (``module``: SGLang's ``sglang.srt.entrypoints.engine``) reads
    that call as "this engine's processes". SGLang registered the shutdown to run at exit too;
    done here, it is unregistered."""
    import atexit

    real = getattr(module, "kill_process_tree", None)

    def own_only(parent_pid: int | None = None, include_parent: bool = True, skip_pid: int | None = None,
                 wait_timeout: float | None = None) -> None:
        if parent_pid in (None, os.getpid()) and not include_parent:
            _stop(own - {skip_pid} if skip_pid else own, wait_timeout or 60.0, tree=True, kill_now=True)
        elif real is not None:
            real(parent_pid, include_parent=include_parent, skip_pid=skip_pid, wait_timeout=wait_timeout)

    with _SHUTDOWN_LOCK:
        if real is not None:
            module.kill_process_tree = own_only
        try:
            engine.shutdown()
        finally:
            if real is not None:
                module.kill_process_tree = real
    atexit.unregister(engine.shutdown)


async def _close_sockets(*owners: Any) -> int:
    return close_zmq_contexts(*owners)


def close_zmq_contexts(*owners: Any) -> int:
    """Destroy, without waiting (linger 0), the ZeroMQ contexts of the sockets ``owners`` hold as
    attributes; returns how many.

    SGLang's shutdown leaves its tokenizer manager's sockets open. When the engine is garbage
    collected later, pyzmq may finalise a socket first (closing it with ZeroMQ's default linger,
    forever) and then its context, whose ``term()`` waits for that socket's unsent messages to a
    scheduler that no longer exists: the collecting thread hangs wherever the collection happens
    (on the H200, inside the next engine's start). Destroyed here first, nothing waits."""
    try:
        import zmq
    except ImportError:  # no ZeroMQ, no sockets of it
        return 0
    contexts: dict[int, Any] = {}
    for owner in owners:
        for value in vars(owner).values() if owner is not None else ():
            if isinstance(value, zmq.Socket) and not value.context.closed:
                contexts[id(value.context)] = value.context
    for context in contexts.values():
        context.destroy(linger=0)
    return len(contexts)


class SglangCallFailed(RuntimeError):
    """SGLang answered a control call with ``success=False``."""


class SglangRuntime(Protocol):
    """What :class:`~.engine.SglangEngine` needs from SGLang (one engine, all its TP ranks)."""

    tp_size: int
    tokenizer: Any
    vocab_size: int | None
    context_length: int | None
    #: SGLang's ``custom_weight_loader`` server argument: the dotted paths ``update_from_tensor``
    #: may name as ``load_format`` (the engine sends :data:`.loader.LOADER` only if listed).
    weight_loaders: tuple[str, ...]

    async def generate(self, **kwargs: Any) -> list[dict[str, Any]]: ...
    async def flush_cache(self) -> None: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def release_memory(self, tags: Sequence[str]) -> None: ...
    async def resume_memory(self, tags: Sequence[str]) -> None: ...
    async def init_weights_group(
        self, host: str, port: int, rank_offset: int, world_size: int, group_name: str
    ) -> None: ...
    async def destroy_weights_group(self, group_name: str) -> None: ...
    async def update_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> None: ...
    async def update_from_tensor(self, payloads: list[bytes], load_format: str = "flattened_bucket") -> None: ...
    async def update_from_disk(self, path: str) -> None: ...
    def serialize(self, obj: Any) -> bytes: ...
    def shutdown(self) -> None: ...


#: SGLang's own pause modes (``PauseGenerationReqInput.mode`` in SGLang's
#: python/sglang/srt/managers/io_struct.py): ``abort`` ends the running requests, ``retract`` moves
#: them back to the waiting queue (their KV cache may be flushed and is recomputed on continue),
#: ``in_place`` keeps them in the running batch with their KV cache.
SglangPauseMode = Literal["abort", "retract", "in_place"]


@runtime_checkable
class SglangStreamingRuntime(SglangRuntime, Protocol):
    """A runtime that also streams, aborts by request id and pauses in SGLang's modes (the
    in-process one). Runtimes without these (e.g. a plain HTTP adapter) still serve
    :class:`~.engine.SglangEngine`; it then declares none of the capabilities they back."""

    #: SGLang's ``incremental_streaming_output``: stream chunks carry only the new tokens (and
    #: logprobs); otherwise each chunk carries everything so far (SGLang's default).
    incremental_stream: bool

    def generate_stream(self, **kwargs: Any) -> AsyncIterator[dict[str, Any]]: ...
    async def abort(self, rid: str | None) -> None: ...
    async def pause_mode(self, mode: SglangPauseMode) -> None: ...


@runtime_checkable
class SglangLoraRuntime(SglangRuntime, Protocol):
    """A runtime that also loads LoRA adapters from tensors (the in-process one); an engine over a
    runtime without this declares no LoRA capability."""

    async def load_lora_from_tensors(self, name: str, config: dict[str, Any], payloads: list[bytes]) -> None: ...
    async def unload_lora(self, name: str) -> None: ...


def _snapshot(chunk: dict[str, Any]) -> dict[str, Any]:
    """A copy of one stream chunk, taken on SGLang's loop: SGLang's non-incremental intermediate
    chunks hand out its request state's own lists (``output_ids``, logprob lists), which it keeps
    extending (python/sglang/srt/managers/tokenizer_manager.py, ``_handle_batch_output``)."""
    out = dict(chunk)
    if out.get("output_ids") is not None:
        out["output_ids"] = list(out["output_ids"])
    meta = out.get("meta_info")
    if isinstance(meta, dict):
        out["meta_info"] = {k: list(v) if isinstance(v, list) else v for k, v in meta.items()}
    return out


def _check(result: Any, what: str) -> None:
    """SGLang's control calls answer ``(success, message, ...)`` (or an object with them)."""
    if result is None:
        return
    if isinstance(result, tuple):
        success, message = result[0], result[1] if len(result) > 1 else ""
    else:
        # LoRA calls answer LoRAUpdateOutput, whose message is error_message.
        success = getattr(result, "success", True)
        message = getattr(result, "message", None) or getattr(result, "error_message", "")
    if not success:
        raise SglangCallFailed(f"SGLang {what} failed: {message}")


class InProcessRuntime:
    """``sglang.Engine`` on its own loop thread (see the module docstring)."""

    def __init__(self, server_kwargs: dict[str, Any], *, start_timeout_s: float = 600.0) -> None:
        self._loop = LoopThread("roe-sglang")
        before = _descendants()
        try:
            # Constructed on the loop, so sglang.Engine adopts it (get_running_loop()).
            future = self._loop.submit(self._construct(server_kwargs))
            try:
                self._engine = future.result(start_timeout_s)
            except TimeoutError:
                if future.done():
                    raise
                stopped = _stop(_descendants() - before)
                try:  # SGLang notices its schedulers died within its 5 s poll and raises
                    future.result(START_UNWIND_S)
                except BaseException:  # noqa: BLE001 - the start failed, as it should now
                    pass
                raise EngineUnavailable(
                    f"SGLang did not start within {start_timeout_s:.0f} s (option start_timeout_s); the "
                    f"{len(stopped)} processes it had started were stopped. See SGLang's log (option "
                    "log_level='info'); a first start on a machine compiles kernels: raise start_timeout_s"
                ) from None
        except BaseException:
            self._loop.close()
            raise
        #: The processes this engine started (its schedulers, detokenizer and theirs): what its
        #: shutdown ends, leaving other engines' and the host's own children alone.
        self.processes: set[int] = _descendants() - before
        sa = self._engine.server_args
        self.tp_size: int = int(sa.tp_size)
        self.tokenizer = self._engine.tokenizer_manager.tokenizer
        mc = getattr(self._engine.tokenizer_manager, "model_config", None)
        self.vocab_size = getattr(mc, "vocab_size", None)
        self.context_length = getattr(mc, "context_len", None) or getattr(sa, "context_length", None)
        self.incremental_stream = bool(getattr(sa, "incremental_streaming_output", False))
        #: The model's EOS ids (SGLang's ``ModelConfig.hf_eos_token_id``: an int, a set or None).
        eos = getattr(mc, "hf_eos_token_id", None)
        self.eos_token_ids: tuple[int, ...] = (
            (int(eos),) if isinstance(eos, int) else tuple(int(t) for t in eos or ())
        )
        self.weight_loaders: tuple[str, ...] = tuple(getattr(sa, "custom_weight_loader", None) or ())

    @staticmethod
    async def _construct(server_kwargs: dict[str, Any]) -> Any:
        import sglang

        return sglang.Engine(**server_kwargs)

    async def _call(self, coro: Awaitable[T]) -> T:
        return await self._loop.call(coro)

    @property
    def _tm(self) -> Any:
        return self._engine.tokenizer_manager

    async def generate(self, **kwargs: Any) -> list[dict[str, Any]]:
        out = await self._call(self._engine.async_generate(**kwargs))
        return out if isinstance(out, list) else [out]

    async def generate_stream(self, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """SGLang's stream: ``Engine.async_generate(..., stream=True)`` returns the tokenizer
        manager's async generator (python/sglang/srt/entrypoints/engine.py); for a batch it yields
        one chunk per update of any of its requests, each with ``index`` (its place in the batch)
        and ``meta_info['id']`` (its rid) (tokenizer_manager.py, ``_handle_batch_request``). The
        generator lives on SGLang's loop, so every step runs there."""
        engine = self._engine

        async def start() -> Any:
            return await engine.async_generate(stream=True, **kwargs)

        async def step(gen: Any) -> dict[str, Any] | None:
            try:
                chunk = await gen.__anext__()
            except StopAsyncIteration:
                return None
            return _snapshot(chunk)

        gen = await self._call(start())
        try:
            while True:
                chunk = await self._call(step(gen))
                if chunk is None:
                    return
                yield chunk
        finally:
            if not self._loop.closed:
                try:
                    await self._call(gen.aclose())
                except Exception:  # an abandoned stream: its requests are aborted by the engine
                    logger.debug("closing SGLang's stream failed", exc_info=True)

    async def abort(self, rid: str | None) -> None:
        """``TokenizerManager.abort_request(rid=..., abort_all=...)`` (tokenizer_manager.py; a plain
        function that sends ``AbortReq`` to the scheduler, ignoring rids it does not know). The
        aborted request ends with ``finish_reason={'type': 'abort', ...}`` and its tokens so far."""
        tm = self._tm

        async def go() -> None:
            if rid is None:
                tm.abort_request(abort_all=True)
            else:
                tm.abort_request(rid=rid)

        await self._call(go())

    async def flush_cache(self) -> None:
        _check(await self._call(self._tm.flush_cache()), "flush_cache")

    async def weights_checksum(self) -> str:
        """SGLang's checksum of the weights: ``TokenizerManager.check_weights(CheckWeightsReqInput(
        action="checksum"))`` answers ``(success, message, ranks, per_engine_checksum)``, the last a
        sha256 over every TP rank's hash of its parameters and buffers (FP8 weights dequantized with
        their scales; python/sglang/srt/utils/weight_checker.py)."""
        from sglang.srt.managers.io_struct import CheckWeightsReqInput

        result = await self._call(self._tm.check_weights(CheckWeightsReqInput(action="checksum"), None))
        _check(result, "check_weights")
        return str(result[3])

    async def pause(self) -> None:
        await self.pause_mode("in_place")

    async def pause_mode(self, mode: SglangPauseMode) -> None:
        """``TokenizerManager.pause_generation(PauseGenerationReqInput(mode=...))``: ``abort``
        aborts every request and returns once none runs; ``in_place`` / ``retract`` pause the
        scheduler (see :data:`SglangPauseMode`). ``continue_generation`` resumes."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        await self._call(self._tm.pause_generation(PauseGenerationReqInput(mode=mode)))

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self._call(self._tm.continue_generation(ContinueGenerationReqInput()))

    async def release_memory(self, tags: Sequence[str]) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        obj = ReleaseMemoryOccupationReqInput(tags=list(tags))
        _check(await self._call(self._tm.release_memory_occupation(obj, None)), "release_memory_occupation")

    async def resume_memory(self, tags: Sequence[str]) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        obj = ResumeMemoryOccupationReqInput(tags=list(tags))
        _check(await self._call(self._tm.resume_memory_occupation(obj, None)), "resume_memory_occupation")

    async def init_weights_group(
        self, host: str, port: int, rank_offset: int, world_size: int, group_name: str
    ) -> None:
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        obj = InitWeightsUpdateGroupReqInput(
            master_address=host, master_port=port, rank_offset=rank_offset, world_size=world_size,
            group_name=group_name, backend="nccl",
        )
        _check(await self._call(self._tm.init_weights_update_group(obj, None)), "init_weights_update_group")

    async def destroy_weights_group(self, group_name: str) -> None:
        from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput

        obj = DestroyWeightsUpdateGroupReqInput(group_name=group_name)
        _check(await self._call(self._tm.destroy_weights_update_group(obj, None)), "destroy_weights_update_group")

    async def update_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        obj = UpdateWeightsFromDistributedReqInput(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
            flush_cache=False, load_format="flattened_bucket",
        )
        _check(await self._call(self._tm.update_weights_from_distributed(obj, None)), "update_weights_from_distributed")

    async def update_from_tensor(self, payloads: list[bytes], load_format: str = "flattened_bucket") -> None:
        """One payload per TP rank, in the form ``load_format`` takes (see :mod:`.payloads`):
        SGLang's ``flattened_bucket`` or a loader of :attr:`weight_loaders`."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        if len(payloads) != self.tp_size:
            raise ValueError(f"{len(payloads)} payloads for {self.tp_size} TP ranks; give one per rank")
        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=list(payloads), load_format=load_format, flush_cache=False,
        )
        _check(await self._call(self._tm.update_weights_from_tensor(obj, None)), "update_weights_from_tensor")

    async def update_from_disk(self, path: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        obj = UpdateWeightFromDiskReqInput(model_path=path, flush_cache=False)
        _check(await self._call(self._tm.update_weights_from_disk(obj, None)), "update_weights_from_disk")

    async def load_lora_from_tensors(self, name: str, config: dict[str, Any], payloads: list[bytes]) -> None:
        """``TokenizerManager.load_lora_adapter_from_tensors`` (what ``Engine.load_lora_adapter_from_tensors``
        wraps, python/sglang/srt/entrypoints/engine.py) with one flattened-bucket payload per TP rank;
        SGLang registers the adapter as ``name`` only once every rank loaded it."""
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

        if len(payloads) != self.tp_size:
            raise ValueError(f"{len(payloads)} payloads for {self.tp_size} TP ranks; give one per rank")
        obj = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=name, config_dict=config, serialized_named_tensors=list(payloads), load_format="flattened_bucket",
        )
        _check(await self._call(self._tm.load_lora_adapter_from_tensors(obj, None)), "load_lora_adapter_from_tensors")

    async def unload_lora(self, name: str) -> None:
        """``TokenizerManager.unload_lora_adapter``: unregisters ``name``, waits for SGLang's requests
        on it to end, then frees it on every rank."""
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        obj = UnloadLoRAAdapterReqInput(lora_name=name)
        _check(await self._call(self._tm.unload_lora_adapter(obj, None)), "unload_lora_adapter")

    def serialize(self, obj: Any) -> bytes:
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        # CUDA IPC handles then name the GPU by UUID, so each TP rank finds it whatever its
        # CUDA_VISIBLE_DEVICES numbering (SGLang patches its receivers the same way).
        monkey_patch_torch_reductions()
        return MultiprocessingSerializer.serialize(obj)

    def shutdown(self) -> None:
        import sglang.srt.entrypoints.engine as sglang_engine

        engine = self._engine
        try:
            shutdown_own_processes(engine, self.processes, sglang_engine)
        finally:
            try:  # on the loop that uses the sockets, which ZeroMQ requires
                self._loop.submit(_close_sockets(engine, getattr(engine, "tokenizer_manager", None))).result(30)
            finally:
                self._loop.close()
