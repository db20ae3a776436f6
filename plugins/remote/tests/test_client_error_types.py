"""The client's error types where they used to differ by path: a blocking GET after an API-key
reload with no retries left, the last failed attempt of a blocking GET, an error in the middle of a
stream (typed as for a plain call), and SGLang's failed control calls (HTTP 400 with
``{"success": false}``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
import rollout_engines as roe
from fastapi import Request  # module level: FastAPI resolves the handlers' annotations here
from rollout_engines.engine import Capabilities, Engine
from rollout_engines.types import Completion, EngineConfig, GenerateRequest, StreamDelta
from rollout_engines_remote.api_client import ApiClient
from rollout_engines_remote.launch import free_port
from rollout_engines_remote.protocol import RemoteError, RemoteRequestInvalid

from .app_thread import AppThread
from .conftest import start_thread_server

pytestmark = pytest.mark.remote


# ---- ApiClient.get_sync ---------------------------------------------------------------------------
def test_get_sync_with_no_retries_resends_once_after_a_key_reload(tmp_path: Path):
    """A real server (``create_app`` on uvicorn, 127.0.0.1) whose key the client's key file holds
    only after the client was made: the 401 is answered by re-reading the file and sending again,
    which is not a retry, so ``retries=0`` must still get the answer (it used to end in
    ``EngineUnavailable("cannot reach the server (None)")``)."""
    engine = _FailingEngine(EngineConfig(backend="failing", model="m"))
    server = start_thread_server(engine, api_key="new-key-2")
    try:
        key_file = tmp_path / "key"
        key_file.write_text("old-key-1\n")
        api = ApiClient(server.url, api_key_file=key_file, retries=0, backoff_s=5.0)
        key_file.write_text("new-key-2\n")  # the server restarted and wrote a new key
        start = time.perf_counter()
        info = api.get_sync("/info")
        assert info["backend"] == "failing"
        assert time.perf_counter() - start < 4.0  # no backoff: a 401 is no failed attempt
        key_file.write_text("wrong-key-3\n")
        api = ApiClient(server.url, api_key_file=key_file, retries=0)
        with pytest.raises(roe.errors.RolloutEnginesError) as exc:  # a wrong key stays a 401
            api.get_sync("/info")
        assert "cannot reach" not in str(exc.value) and getattr(exc.value, "status", None) == 401
    finally:
        server.stop()


def test_get_sync_does_not_sleep_after_its_last_attempt():
    """Nothing listens on the port: with ``retries=0`` the only attempt fails and the call raises at
    once (it used to sleep ``backoff_s * (0.5 .. 1.5)`` first, here at least 2 s)."""
    api = ApiClient(f"http://127.0.0.1:{free_port()}", retries=0, backoff_s=4.0, connect_timeout_s=5.0)
    start = time.perf_counter()
    with pytest.raises(roe.EngineUnavailable, match="cannot reach the server"):
        api.get_sync("/info")
    assert time.perf_counter() - start < 1.5


# ---- an error in the middle of a stream ------------------------------------------------------------
class _FailingEngine(Engine):
    """Streams one token, then fails with ``error`` (a plain generate fails with the same)."""

    backend_name = "failing"
    capabilities = Capabilities(streaming=True)

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.error: Exception = ValueError("token 2 is not allowed here")

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        raise self.error

    async def _stream(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        rid = (request.request_ids or ["r"])[0]
        yield StreamDelta(request_id=rid, prompt_index=0, sample_index=0, token_ids=[5], weight_version=0)
        await asyncio.sleep(0.01)
        raise self.error


@pytest.fixture(scope="module")
def failing_server() -> Any:
    server = start_thread_server(_FailingEngine(EngineConfig(backend="failing", model="m")))
    yield server
    server.stop()


async def _errors(server: Any) -> tuple[BaseException, BaseException]:
    engine = roe.create_engine("remote", model=server.url, api_key=server.api_key)
    request = GenerateRequest(prompt_token_ids=[[1, 2]])
    try:
        got = []
        with pytest.raises(Exception) as streamed:
            async for delta in engine.stream(request):
                got.append(delta)
        assert [d.token_ids for d in got] == [[5]]  # the error came after the stream started
        # The plain call second.
        with pytest.raises(Exception) as plain:
            await engine.generate(request)
        return plain.value, streamed.value
    finally:
        await engine.close()


@pytest.mark.parametrize("error", [ValueError("token 2 is not allowed here"), KeyError("internal")],
                         ids=["bad-request", "internal"])
async def test_mid_stream_errors_have_the_types_of_plain_calls(failing_server, error):
    """The real server (``create_app``) sends an error event once a stream has started
    (``{"error": {"type": "BadRequest", "code": 400, ...}}`` for a ValueError); the client raises
    what a plain call gets for the same answer, not ``FarEngineError``."""
    failing_server.engine.error = error
    plain, streamed = await _errors(failing_server)
    assert type(streamed) is type(plain), (repr(plain), repr(streamed))
    assert isinstance(streamed, RemoteError) and streamed.status == plain.status
    if isinstance(error, ValueError):
        assert isinstance(streamed, RemoteRequestInvalid) and streamed.type == "BadRequest"
        assert "token 2 is not allowed here" in str(streamed)


async def test_mid_stream_core_errors_stay_typed(failing_server):
    failing_server.engine.error = roe.WeightSyncError("the push broke")
    plain, streamed = await _errors(failing_server)
    assert type(plain) is type(streamed) is roe.WeightSyncError
    assert "the push broke" in str(streamed)


class _GarbledStream(AppThread):
    """A stand-in, not the rollout-engines server (which only writes JSON events): ``/info`` as the
    real one answers it, and a ``/generate/stream`` whose second event is cut short, as a broken
    proxy in between would deliver it."""

    def __init__(self) -> None:
        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse

        app = FastAPI()
        info = {"backend": "failing", "model": "m", "weight_version": 0,
                "capabilities": {"streaming": True}, "extra": {"server": {"weight_receivers": 1}}}
        delta = ('{"request_id": "r", "prompt_index": 0, "sample_index": 0, "token_ids": [5], '
                 '"weight_version": 0}')

        async def events() -> AsyncGenerator[bytes, None]:
            yield f"data: {delta}\n\n".encode()
            yield b'data: {"request_id": "r", "prompt_ind\n\n'
            yield b"data: [DONE]\n\n"

        app.get("/info")(lambda: info)
        app.post("/generate/stream")(lambda: StreamingResponse(events(), media_type="text/event-stream"))
        super().__init__(app)


async def test_a_garbled_stream_event_is_engine_unavailable():
    server = _GarbledStream()
    engine = roe.create_engine("remote", model=server.url)
    try:
        got = []
        with pytest.raises(roe.EngineUnavailable, match="not a JSON event"):
            async for delta in engine.stream(GenerateRequest(prompt_token_ids=[[1, 2]])):
                got.append(delta)
        assert [d.token_ids for d in got] == [[5]]
    finally:
        await engine.close()
        server.stop()


# ---- SGLang: failed control calls --------------------------------------------------------------------
class _SglangControlStandIn(AppThread):
    """A stand-in for SGLang's HTTP server, which cannot run here (no GPU, SGLang not installed):
    FastAPI + uvicorn on 127.0.0.1, answering a failed control call as SGLang does. In
    sgl-project/sglang ``python/sglang/srt/entrypoints/http_server.py`` (commit 0025436e),
    ``update_weights_from_disk`` builds ``content = {"success": success, "message": message,
    "num_paused_requests": num_paused_requests}`` and answers it with
    ``ORJSONResponse(content, status_code=HTTPStatus.BAD_REQUEST)`` when ``success`` is false;
    ``init_weights_update_group``, ``update_weights_from_distributed``, ``update_weights_from_tensor``
    and ``destroy_weights_update_group`` answer ``{"success", "message"}`` the same way, and
    ``load_lora_adapter`` / ``unload_lora_adapter`` the result object with 400. A request that fails
    FastAPI's validation is answered by its ``RequestValidationError`` handler: 400 with
    ``ErrorResponse(message=..., type="Bad Request", code=400)`` (``object: "error"``), no ``success``."""

    def __init__(self, model_path: str) -> None:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI()

        @app.get("/get_model_info")
        async def model_info() -> dict[str, Any]:
            return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True}

        @app.get("/get_server_info")
        async def server_info() -> dict[str, Any]:
            return {"tp_size": 1, "context_length": 2048}

        @app.post("/update_weights_from_disk")
        async def from_disk(request: Request) -> JSONResponse:
            body = await request.json()
            if not isinstance(body.get("model_path"), str):
                return JSONResponse({"object": "error", "message": "model_path: Field required",
                                     "type": "Bad Request", "param": None, "code": 400}, status_code=400)
            return JSONResponse({"success": False, "num_paused_requests": 0,
                                 "message": f"Failed to get weights iterator: {body['model_path']} not found"},
                                status_code=400)

        @app.post("/init_weights_update_group")
        async def init_group(request: Request) -> JSONResponse:
            return JSONResponse({"success": False, "message": "Failed to init group: timeout"}, status_code=400)

        super().__init__(app)


async def test_sglang_failed_control_calls_raise_sglang_call_failed(tiny_model):
    pytest.importorskip("rollout_engines_sglang", reason="the sglang adapter reuses rollout-engines-sglang")
    from rollout_engines_remote.adapters.sglang import HttpSglangRuntime
    from rollout_engines_sglang.runtime import SglangCallFailed

    server = _SglangControlStandIn(str(tiny_model))
    try:
        runtime = HttpSglangRuntime(ApiClient(server.url, retries=0))
        with pytest.raises(SglangCallFailed, match="update_weights_from_disk failed: .*/nowhere not found"):
            await runtime.update_from_disk("/nowhere")
        with pytest.raises(SglangCallFailed, match="init_weights_update_group failed: Failed to init group"):
            await runtime.init_weights_group("127.0.0.1", 1234, 1, 2, "g")
        # A 400 that is no failed call (a malformed request) stays the client's typed error.
        with pytest.raises(RemoteRequestInvalid, match="Field required"):
            await runtime._post("/update_weights_from_disk", {"model_path": None}, "update_weights_from_disk")
        await runtime.api.aclose()
    finally:
        server.stop()


def test_an_unexpected_server_error_keeps_the_keep_alive_connection():
    """A 500 (an engine error the server did not expect) is answered and logged; the client's
    keep-alive connection stays open for its next request (uvicorn closed it, so a request sent on
    the pooled connection at that moment failed with no answer)."""
    import httpx

    engine = _FailingEngine(EngineConfig(backend="failing", model="m"))
    engine.error = KeyError("no such thing")
    server = start_thread_server(engine, api_key="k")
    body = {"prompt_token_ids": [[1, 2]], "sampling": {"max_tokens": 2}}
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=30) as client:
            ports = []
            for _ in range(2):
                resp = client.post("/generate", json=body)
                assert resp.status_code == 500 and resp.json()["error"]["type"] == "InternalError"
                ports.append(resp.extensions["network_stream"].get_extra_info("client_addr")[1])
            assert client.get("/health").status_code == 200
            assert ports[0] == ports[1], "the server closed the connection after its 500"
    finally:
        server.stop()
