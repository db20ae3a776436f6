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
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol, TypeVar

from rollout_engines.backend_kit import LoopThread

logger = logging.getLogger("rollout_engines.sglang")

T = TypeVar("T")


class SglangCallFailed(RuntimeError):
    """SGLang answered a control call with ``success=False``."""


class SglangRuntime(Protocol):
    """What :class:`~.engine.SglangEngine` needs from SGLang (one engine, all its TP ranks)."""

    tp_size: int
    tokenizer: Any
    vocab_size: int | None
    context_length: int | None

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
    async def update_from_tensor(self, payloads: list[bytes]) -> None: ...
    async def update_from_disk(self, path: str) -> None: ...
    def serialize(self, obj: Any) -> bytes: ...
    def shutdown(self) -> None: ...


def _check(result: Any, what: str) -> None:
    """SGLang's control calls answer ``(success, message, ...)`` (or an object with them)."""
    if result is None:
        return
    if isinstance(result, tuple):
        success, message = result[0], result[1] if len(result) > 1 else ""
    else:
        success, message = getattr(result, "success", True), getattr(result, "message", "")
    if not success:
        raise SglangCallFailed(f"SGLang {what} failed: {message}")


class InProcessRuntime:
    """``sglang.Engine`` on its own loop thread (see the module docstring)."""

    def __init__(self, server_kwargs: dict[str, Any]) -> None:
        self._loop = LoopThread("roe-sglang")
        try:
            # Constructed on the loop, so sglang.Engine adopts it (get_running_loop()).
            self._engine = self._loop.run(self._construct(server_kwargs))
        except BaseException:
            self._loop.close()
            raise
        sa = self._engine.server_args
        self.tp_size: int = int(sa.tp_size)
        self.tokenizer = self._engine.tokenizer_manager.tokenizer
        mc = getattr(self._engine.tokenizer_manager, "model_config", None)
        self.vocab_size = getattr(mc, "vocab_size", None)
        self.context_length = getattr(mc, "context_len", None) or getattr(sa, "context_length", None)

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

    async def flush_cache(self) -> None:
        _check(await self._call(self._tm.flush_cache()), "flush_cache")

    async def pause(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        # in_place: running requests stay in the batch (with their KV cache) and continue later.
        await self._call(self._tm.pause_generation(PauseGenerationReqInput(mode="in_place")))

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

    async def update_from_tensor(self, payloads: list[bytes]) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        if len(payloads) != self.tp_size:
            raise ValueError(f"{len(payloads)} payloads for {self.tp_size} TP ranks; give one per rank")
        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=list(payloads), load_format="flattened_bucket", flush_cache=False,
        )
        _check(await self._call(self._tm.update_weights_from_tensor(obj, None)), "update_weights_from_tensor")

    async def update_from_disk(self, path: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        obj = UpdateWeightFromDiskReqInput(model_path=path, flush_cache=False)
        _check(await self._call(self._tm.update_weights_from_disk(obj, None)), "update_weights_from_disk")

    def serialize(self, obj: Any) -> bytes:
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        # CUDA IPC handles then name the GPU by UUID, so each TP rank finds it whatever its
        # CUDA_VISIBLE_DEVICES numbering (SGLang patches its receivers the same way).
        monkey_patch_torch_reductions()
        return MultiprocessingSerializer.serialize(obj)

    def shutdown(self) -> None:
        try:
            self._engine.shutdown()
        finally:
            self._loop.close()
