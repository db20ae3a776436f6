"""``RecordingEngine``: a small real :class:`Engine` (the base class's rules apply) that records every
public call it receives, for the test that every proxy forwards every method (a test double, not a
model: its "generation" repeats each prompt's last token).

The record is read back through the proxy itself: ``(await engine.info()).extra["calls"]``.
``options["close_marker"]``: a file it writes when it is closed (a closed far engine cannot answer
``info`` any more). A weight update whose ``session_id`` is ``"refuse"`` fails with a
:class:`WeightSyncError` naming a peer and a bucket. LoRA pushes are taken (nothing is kept: the
base class keeps the names and versions).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from rollout_engines import Capabilities, Completion, Engine, EngineConfig, GenerateRequest
from rollout_engines.engine import EngineProtocol
from rollout_engines.errors import WeightSyncError
from rollout_engines.types import PauseMode, StreamDelta
from rollout_engines.weights.manifest import TransportSpec, WeightManifest


class RecordingEngine(Engine):
    backend_name = "recording"
    capabilities = Capabilities(
        chat=True, n=True, pause=True, prefix_cache=True, weights_kept_on_sleep=True,
        sleep_levels=(1,), sleep_tags=("weights", "kv_cache"),
        pause_modes=("abort", "keep"), streaming=True, abort=True, transports=("gloo",), lora=8, max_loras=2,
    )

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.calls: list[str] = []
        self.aborted: list[str | None] = []
        self.cache_resets = 0
        self.step_s = float(config.options.get("step_s", 0.0))

    def _extra_info(self) -> dict[str, Any]:
        return {"calls": list(self.calls), "aborted": list(self.aborted), "cache_resets": self.cache_resets}

    @staticmethod
    def _prompts(request: GenerateRequest) -> list[list[int]]:
        if request.prompt_token_ids is not None:
            return [list(p) for p in request.prompt_token_ids]
        if request.messages is not None:
            return [[len(conv)] for conv in request.messages]
        return [[len(p)] for p in request.prompts or []]

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        s, ids = request.sampling, request.request_ids or []
        outs = []
        for i, prompt in enumerate(self._prompts(request)):
            for j in range(s.n):
                outs.append(Completion(
                    request_id=ids[i * s.n + j] if ids else "", prompt_index=i, sample_index=j,
                    prompt_token_ids=prompt, token_ids=[prompt[-1]] * s.max_tokens, text="",
                    finish_reason="length", weight_version=self.weight_version,
                ))
        return outs

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        s, ids = request.sampling, request.request_ids or []
        for i, prompt in enumerate(self._prompts(request)):
            for j in range(s.n):
                for step in range(s.max_tokens):
                    await asyncio.sleep(self.step_s)
                    yield StreamDelta(
                        request_id=ids[i * s.n + j], prompt_index=i, sample_index=j, token_ids=[prompt[-1]],
                        weight_version=self.weight_version,
                        finish_reason="length" if step == s.max_tokens - 1 else None,
                    )

    async def _abort(self, request_ids: Sequence[str] | None) -> None:
        self.aborted.extend(request_ids if request_ids is not None else [None])

    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        return None

    async def _wake_up(self, tags: Sequence[str]) -> None:
        return None

    async def _reset_prefix_cache(self) -> None:
        self.cache_resets += 1

    async def _pause(self, mode: PauseMode) -> None:
        return None

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        return None

    async def _receive_weights(self, manifest: WeightManifest) -> None:
        if manifest.session_id == "refuse":
            raise WeightSyncError("the trainer sent a bad bucket", peer="trainer (rank 0)", bucket=3)

    async def _receive_lora(self, manifest: WeightManifest) -> None:
        return None

    async def _unload_lora(self, name: str) -> None:
        return None

    async def _close(self) -> None:
        marker = self.config.options.get("close_marker")
        if marker:
            Path(marker).write_text("closed")


def _recorded(name: str) -> Any:
    base = getattr(Engine, name)
    if name == "stream":
        async def stream(self: RecordingEngine, *args: Any, **kwargs: Any) -> AsyncIterator[StreamDelta]:
            self.calls.append(name)
            async for delta in base(self, *args, **kwargs):
                yield delta

        return stream

    async def method(self: RecordingEngine, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(name)
        return await base(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in EngineProtocol.methods():
    setattr(RecordingEngine, _name, _recorded(_name))
