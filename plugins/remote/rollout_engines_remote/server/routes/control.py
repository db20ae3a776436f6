"""The control plane: sleep and wake, the prefix cache, pause and resume, unloading LoRA adapters."""

from __future__ import annotations

from fastapi import APIRouter

from ...protocol import LoraUnloadBody, LoraUnloadedBody, OkBody, PauseBody, SleepBody, WakeUpBody
from ..state import ServerState


def router(state: ServerState) -> APIRouter:
    r = APIRouter(tags=["control"])
    engine = state.engine

    def ok() -> OkBody:
        return OkBody(weight_version=engine.weight_version)

    @r.post("/sleep", response_model=OkBody)
    async def sleep(body: SleepBody | None = None) -> OkBody:
        body = body or SleepBody()
        await engine.sleep(body.level, body.tags)
        return ok()

    @r.post("/wake_up", response_model=OkBody)
    async def wake_up(body: WakeUpBody | None = None) -> OkBody:
        await engine.wake_up((body or WakeUpBody()).tags)
        return ok()

    @r.post("/reset_prefix_cache", response_model=OkBody)
    async def reset_prefix_cache() -> OkBody:
        await engine.reset_prefix_cache()
        return ok()

    @r.post("/pause", response_model=OkBody)
    async def pause(body: PauseBody | None = None) -> OkBody:
        """Hold new generation until ``/resume``; ``mode`` (default ``wait``) says what happens to
        requests in flight (``wait``: answers once they finished; ``abort``: they end now; ``keep``:
        they freeze until ``/resume``). A mode the engine does not serve is a 400 (``pause_modes``)."""
        await engine.pause((body or PauseBody()).mode)
        return ok()

    @r.post("/resume", response_model=OkBody)
    async def resume() -> OkBody:
        await engine.resume()
        return ok()

    @r.post("/lora/unload", response_model=LoraUnloadedBody)
    async def unload_lora(body: LoraUnloadBody) -> LoraUnloadedBody:
        """Unload a LoRA adapter (``Engine.unload_lora``); ``unloaded`` says whether it was loaded.
        Adapters arrive as weight updates whose manifest has ``lora`` (``/weights/update``); the
        loaded ones and their versions are in ``/info``'s ``loras``."""
        return LoraUnloadedBody(unloaded=await engine.unload_lora(body.name))

    return r
