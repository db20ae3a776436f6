"""Real servers for the remote plugin's tests: uvicorn on 127.0.0.1 free ports, in a thread of the
test process (fast, shares the engine object) or in a child process (``rollout-engines serve``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

API_KEY = "test-key-5f1c"


@dataclass
class ThreadServer:
    url: str
    app: Any
    engine: Any
    api_key: str | None
    server: Any
    thread: threading.Thread

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def outstanding(server: ThreadServer) -> int:
    """The requests the server's engine counts in flight (``/info``)."""
    return int(httpx.get(server.url + "/info", headers=server.headers, timeout=30).json()["outstanding"])


def wait_until(check: Any, timeout_s: float, what: str, every_s: float = 0.05) -> float:
    """Poll ``check()`` until it is true (AssertionError naming ``what`` past ``timeout_s``);
    returns the seconds it took."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(every_s)
    return time.monotonic() - start


def start_thread_server(engine: Any, api_key: str | None = API_KEY, *, host: str = "127.0.0.1", port: int | None = None,
                        **app_kwargs: Any) -> ThreadServer:
    """``create_app(engine, api_key=..., bind_host=host, **app_kwargs)`` served by uvicorn on
    ``host:port`` (a free port by default) from a thread of this process."""
    import uvicorn
    from rollout_engines_remote.launch import free_port
    from rollout_engines_remote.server import create_app

    port = port or free_port(host)
    app = create_app(engine, api_key=api_key, bind_host=host, **app_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", backlog=2048))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return ThreadServer(f"http://{host}:{port}", app, engine, api_key, server, thread)


@pytest.fixture(scope="module")
def thread_server(tiny_model: Path) -> Iterator[ThreadServer]:
    """A transformers engine served from a thread of this process, with an API key and a small
    body limit (64 KiB) so that 413 is cheap to provoke."""
    import rollout_engines as roe

    engine = roe.create_engine("transformers", model=str(tiny_model))
    ts = start_thread_server(engine, max_body_bytes=64 * 1024)
    yield ts
    ts.stop()


@pytest.fixture(scope="session")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``rollout-engines serve --backend transformers`` on the tiny model, in a child process."""
    from rollout_engines_remote.launch import ServerProcess

    log = tmp_path_factory.mktemp("served") / "server.log"
    with ServerProcess("transformers", str(tiny_model), api_key=API_KEY, log=log) as server:
        yield server


@pytest.fixture
def remote_options() -> dict[str, Any]:
    return {"api_key": API_KEY}
