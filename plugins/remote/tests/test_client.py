"""The client's retry rule (idempotent calls only, with backoff), its typed errors, and graceful
shutdown of a served engine with requests in flight."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import rollout_engines as roe
from rollout_engines_remote.launch import ServerProcess, free_port
from rollout_engines_remote.protocol import RemoteAuthError, RemoteRequestInvalid

from .app_thread import AppThread

pytestmark = pytest.mark.remote


class FakeFlakyServer(AppThread):
    """A fake, because a real server cannot be made to answer 503 on demand: it fails the first
    ``failures`` calls of each path with 503 and counts every call it gets."""

    def __init__(self, failures: int) -> None:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        self.calls: dict[str, int] = {}
        app = FastAPI()
        info = {"backend": "transformers", "model": "m", "weight_version": 7,
                "capabilities": {"transports": ["gloo"]}, "extra": {"server": {"weight_receivers": 1}}}

        def flaky(path: str, body: object) -> JSONResponse:
            n = self.calls[path] = self.calls.get(path, 0) + 1
            if n <= failures:
                return JSONResponse({"error": {"type": "Busy", "message": "try later"}}, status_code=503)
            return JSONResponse(body)

        app.get("/info")(lambda: flaky("/info", info))
        app.get("/health")(lambda: flaky("/health", {"status": "ok"}))
        app.post("/generate")(lambda: flaky("/generate", []))
        super().__init__(app)


async def test_idempotent_calls_retry_generate_never_does():
    fake = FakeFlakyServer(failures=2)
    try:
        engine = roe.create_engine("remote", model=fake.url, retries=3, backoff_s=0.01)
        assert fake.calls["/info"] == 3  # two 503s, then the answer
        assert engine.weight_version == 7
        assert await engine.health()
        assert fake.calls["/health"] == 3
        request = roe.GenerateRequest(prompt_token_ids=[[1]])
        with pytest.raises(roe.EngineUnavailable, match="try later"):
            await engine.generate(request)
        assert fake.calls["/generate"] == 1  # a generate that reached the server is never re-sent
        await engine.close()
    finally:
        fake.stop()


async def test_retries_give_up_with_backoff_and_a_clear_error():
    fake = FakeFlakyServer(failures=100)
    try:
        start = time.perf_counter()
        with pytest.raises(roe.EngineUnavailable, match="try later"):
            roe.create_engine("remote", model=fake.url, retries=2, backoff_s=0.05)
        assert fake.calls["/info"] == 3
        assert time.perf_counter() - start >= 0.05 * 0.5 * (1 + 2)  # 0.05 * 2**attempt * jitter >= 0.5
    finally:
        fake.stop()


def test_unreachable_server_is_engine_unavailable():
    with pytest.raises(roe.EngineUnavailable, match="cannot reach the server"):
        roe.create_engine("remote", model=f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01)


def test_bad_url_says_what_to_pass():
    with pytest.raises(ValueError, match="needs a server URL"):
        roe.create_engine("remote", model="/models/qwen")


async def test_client_errors_are_typed(thread_server):
    with pytest.raises(RemoteAuthError, match="API key"):
        roe.create_engine("remote", model=thread_server.url, api_key="nope", retries=0)
    engine = roe.create_engine("remote", model=thread_server.url, api_key=thread_server.api_key)
    try:
        with pytest.raises(RemoteRequestInvalid, match="outside the vocabulary") as info:
            await engine.generate(roe.GenerateRequest(prompt_token_ids=[[10**6]]))
        assert info.value.status == 422 and info.value.param == "prompt_token_ids"
        with pytest.raises(roe.CapabilityError, match="cannot receive weights over 'cuda_ipc'.*http"):
            await engine.init_weight_transfer(roe.TransportSpec(transport="cuda_ipc", session_id="s"))
        assert "inproc" not in engine.capabilities.transports  # another process: no in-process queues
        await engine.sleep()
        assert (await engine.info()).asleep == ["kv_cache", "weights"]
        with pytest.raises(roe.EngineAsleep):
            await engine.generate(roe.GenerateRequest(prompt_token_ids=[[1]]))
        await engine.wake_up()
        outs = await engine.generate(roe.GenerateRequest(prompt_token_ids=[[1, 2]]))
        assert len(outs) == 1
    finally:
        await engine.close()
        await engine.close()  # idempotent
    with pytest.raises(roe.EngineClosed):
        await engine.generate(roe.GenerateRequest(prompt_token_ids=[[1]]))


def test_graceful_shutdown_finishes_in_flight_requests(tiny_model, tmp_path):
    server = ServerProcess("transformers", str(tiny_model), log=tmp_path / "log", extra_args=["--grace-period", "60"])
    server.start()
    try:
        body = {"prompt_token_ids": [[1, 2, 3]] * 8,
                "sampling": {"temperature": 0, "max_tokens": 400, "ignore_eos": True}}

        async def go() -> tuple[list[httpx.Response], int | None]:
            async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:
                pending = [asyncio.ensure_future(c.post("/generate", json=body)) for _ in range(3)]
                # Stop once all three run (a fixed 1 s sleep let them finish first: 0.8 s here).
                deadline = time.monotonic() + 60
                while (await c.get("/info")).json()["outstanding"] < 3:
                    assert time.monotonic() < deadline, "the three requests did not reach the engine in 60 s"
                    await asyncio.sleep(0.01)
                code = await asyncio.to_thread(server.stop)
                return list(await asyncio.gather(*pending)), code

        responses, code = asyncio.run(go())
        assert code == 0
        for r in responses:
            assert r.status_code == 200
            outs = r.json()
            assert len(outs) == 8 and all(len(o["token_ids"]) == 400 for o in outs)
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=5)
    finally:
        server.stop()


def test_shutdown_aborts_cleanly_after_the_grace_period(tiny_model, tmp_path):
    server = ServerProcess("transformers", str(tiny_model), log=tmp_path / "log", extra_args=["--grace-period", "1"])
    server.start()
    try:
        body = {"prompt_token_ids": [[1, 2, 3]] * 16,
                "sampling": {"temperature": 0, "max_tokens": 2000, "ignore_eos": True}}

        async def go() -> tuple[BaseException | httpx.Response, int | None, float]:
            async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as c:
                pending = asyncio.ensure_future(c.post("/generate", json=body))
                await asyncio.sleep(1.0)
                start = time.perf_counter()
                code = await asyncio.to_thread(server.stop)
                seconds = time.perf_counter() - start
                done = (await asyncio.gather(pending, return_exceptions=True))[0]
                return done, code, seconds

        done, code, seconds = asyncio.run(go())
        assert code == 0
        assert seconds < 20  # grace period + engine close timeout, not the whole generation
        # The aborted request ends: an error response or a closed connection, never a hang.
        assert isinstance(done, httpx.HTTPError) or done.status_code >= 500
    finally:
        server.stop()
