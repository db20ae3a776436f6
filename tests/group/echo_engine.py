"""``EchoEngine``: a small, deterministic engine for router-level tests (a test double, not a model).

It is a real :class:`Engine` subclass (the base class's rules apply) whose "model" is one tensor
``bias`` (shape ``[workers, 4]``): every output token is ``prompt token + sum(bias)`` modulo 1000, so
a weight push changes the output. It receives weights through real :class:`WeightReceiver` s, one
per "worker", over the ``inproc`` or ``disk`` transport, so rank offsets in a group are exercised for real.

Test controls: ``delay_s`` keeps requests in flight; :meth:`crash` makes the engine fail like a
dead process (in-flight and new requests raise :class:`EngineUnavailable`, health is False);
:meth:`restart` brings it back as a fresh process would be: initial weights, version 0, no session.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import torch
from rollout_engines import Capabilities, Completion, Engine, EngineConfig, GenerateRequest
from rollout_engines.errors import EngineUnavailable
from rollout_engines.weights.manifest import TransportSpec, WeightManifest
from rollout_engines.weights.receiver import StateDictTarget, WeightReceiver

VOCAB = 1000
#: A prompt starting with this token makes _generate raise a RuntimeError (a bug, not a dead engine).
POISON = 666


class _Bias(torch.nn.Module):
    def __init__(self, workers: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(workers, 4), requires_grad=False)


class EchoEngine(Engine):
    backend_name = "echo"
    capabilities = Capabilities(
        chat=True, logprobs=True, n=True, seed=True, pause=True, prefix_cache=True, weights_kept_on_sleep=True,
        sleep_levels=(1,), sleep_tags=("weights", "kv_cache"), transports=("inproc", "disk"),
    )

    def __init__(self, name: str = "echo", *, delay_s: float = 0.0, workers: int = 1) -> None:
        super().__init__(EngineConfig(backend="echo", model=f"echo:{name}"))
        self.name, self.delay_s, self.workers = name, delay_s, workers
        self.served: Counter[str] = Counter()  # request tag -> times answered
        self.order: list[str] = []  # request tags in the order they were answered
        self.calls = 0
        self.concurrent = 0
        self.max_concurrent = 0
        self.crashed = False
        self.slept = 0
        self.paused_calls = 0
        self.prefix_resets = 0
        self._inflight: set[asyncio.Future[None]] = set()
        self._fresh_model()

    def _fresh_model(self) -> None:
        self.module = _Bias(self.workers)
        self.receivers: list[WeightReceiver] = []
        self.ranks: list[int] = []

    def weight_receivers(self) -> int:
        return self.workers

    def offset(self) -> int:
        return int(round(float(self.module.bias.sum()))) % VOCAB

    # ---- controls ------------------------------------------------------------------------------
    def crash(self) -> None:
        """Fail like a dead process: in-flight requests and every later call raise."""
        self.crashed = True
        for fut in list(self._inflight):
            if not fut.done():
                fut.set_exception(EngineUnavailable(f"{self.name} crashed"))

    def restart(self) -> None:
        """Come back like a restarted process: initial weights, version 0, no weight session."""
        self.crashed = False
        self.weight_version = 0
        self._asleep.clear()
        self._weights_invalid = None
        self._fresh_model()

    def _alive(self) -> None:
        if self.crashed:
            raise EngineUnavailable(f"{self.name} crashed")

    # ---- engine hooks --------------------------------------------------------------------------
    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        self._alive()
        self.calls += 1
        self.concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            return await self._answer(request)
        finally:
            self.concurrent -= 1

    async def _answer(self, request: GenerateRequest) -> list[Completion]:
        prompts = request.prompt_token_ids or [[len(p)] for p in (request.prompts or [])]
        if any(t >= VOCAB for p in prompts for t in p):
            raise ValueError(f"token ids must be < {VOCAB} for this engine")
        if prompts[0][0] == POISON:
            raise RuntimeError("this prompt breaks the engine's code (but not the engine)")
        if self.delay_s:
            fut = asyncio.get_running_loop().create_future()
            self._inflight.add(fut)
            handle = asyncio.get_running_loop().call_later(self.delay_s, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                handle.cancel()
                self._inflight.discard(fut)
        self._alive()
        tag = request.session_id or "-"
        self.served[tag] += 1
        self.order.append(tag)
        off = self.offset()
        n = request.sampling.max_tokens
        return [
            Completion(
                prompt_index=i, prompt_token_ids=p, token_ids=[(p[-1] + off + k) % VOCAB for k in range(n)],
                finish_reason="length", weight_version=self.weight_version,
            )
            for i, p in enumerate(prompts)
        ]

    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        self._alive()
        self.slept += 1

    async def _wake_up(self, tags: Sequence[str]) -> None:
        self._alive()

    async def _reset_prefix_cache(self) -> None:
        self._alive()
        self.prefix_resets += 1

    async def _pause(self, mode: str = "wait") -> None:
        self._alive()
        self.paused_calls += 1

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        self._alive()
        self.receivers = []
        self.ranks = []
        for local in range(self.workers):
            receiver = WeightReceiver(_WorkerTarget(self.module, local), label=f"{self.name}/{local}")
            receiver.connect(spec, local_rank=local)
            self.receivers.append(receiver)
            self.ranks.append(spec.rank_offset + local)

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        self._alive()
        if not self.receivers:
            raise EngineUnavailable(f"{self.name} has no weight session (restarted?)")
        await asyncio.gather(*(asyncio.to_thread(r.receive, manifest) for r in self.receivers))

    async def _close_weight_transfer(self) -> None:
        for r in self.receivers:
            r.close()
        self.receivers = []

    async def health(self) -> bool:
        return not self.crashed and await super().health()


class _WorkerTarget(StateDictTarget):
    """Worker ``local`` owns row ``local`` of the bias (like a TP shard; here each worker receives
    the full tensor and keeps its row)."""

    def __init__(self, module: torch.nn.Module, local: int) -> None:
        super().__init__(module)
        self.local = local

    def apply(self, named, *, owned: bool) -> None:  # type: ignore[no-untyped-def]
        with torch.no_grad():
            for name, tensor in named:
                if name == "bias":
                    self.module.bias[self.local].copy_(tensor[self.local])


def echo_tokens(prompt_last: int, offset: int, n: int) -> list[int]:
    return [(prompt_last + offset + k) % VOCAB for k in range(n)]


class AbortableEcho(EchoEngine):
    """An :class:`EchoEngine` whose requests can be aborted (``abort`` capability): a request runs
    ``delay_s`` seconds, or until its id is aborted (then it returns ``finish_reason="abort"`` and no
    tokens). Extra test controls: ``broken`` makes every request raise a ``RuntimeError`` (a generic
    error, not an engine failure) and the health check fail, after ``health_delay_s`` seconds;
    ``late_poison`` raises the :data:`POISON` prompt's ``RuntimeError`` only after the delay (the
    request was in flight meanwhile)."""

    capabilities = EchoEngine.capabilities.model_copy(update={"abort": True})

    def __init__(self, name: str = "echo", *, delay_s: float = 0.0, workers: int = 1) -> None:
        super().__init__(name, delay_s=delay_s, workers=workers)
        self.broken = False
        self.late_poison = False
        self.health_delay_s = 0.0
        self.health_checks = 0
        self.aborted: list[str] = []  # ids this engine ended early
        self._running: dict[str, asyncio.Future[None]] = {}

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        self._alive()
        if self.broken:
            raise RuntimeError(f"{self.name} is broken")
        prompts = request.prompt_token_ids or [[1]]
        if prompts[0][0] == POISON and not self.late_poison:
            raise RuntimeError("this prompt breaks the engine's code (but not the engine)")
        ids = list(request.request_ids or ())
        self.calls += 1
        self.concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        self._inflight.add(ended)
        for rid in ids:
            self._running[rid] = ended
        handle = loop.call_later(self.delay_s, lambda: ended.done() or ended.set_result(None))
        try:
            await ended
        finally:
            handle.cancel()
            self._inflight.discard(ended)
            for rid in ids:
                self._running.pop(rid, None)
            self.concurrent -= 1
        self._alive()
        if prompts[0][0] == POISON:
            raise RuntimeError("this prompt breaks the engine's code (but not the engine)")
        aborted = any(rid in self.aborted for rid in ids)
        tag = request.session_id or "-"
        self.served[tag] += 1
        self.order.append(tag)
        n = 0 if aborted else request.sampling.max_tokens
        return [
            Completion(prompt_index=i, prompt_token_ids=p, token_ids=echo_tokens(p[-1], self.offset(), n),
                       finish_reason="abort" if aborted else "length", weight_version=self.weight_version)
            for i, p in enumerate(prompts)
        ]

    def release(self) -> None:
        """End every running request now, as if its ``delay_s`` had passed (not aborted)."""
        for ended in list(self._inflight):
            if not ended.done():
                ended.set_result(None)

    async def _abort(self, request_ids: Sequence[str] | None) -> None:
        self._alive()
        for rid in list(self._running) if request_ids is None else request_ids:
            ended = self._running.get(rid)
            if ended is not None and not ended.done():
                self.aborted.append(rid)
                ended.set_result(None)

    async def health(self) -> bool:
        self.health_checks += 1
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return not self.broken and await super().health()
