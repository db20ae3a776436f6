"""Start a rollout-engines server in a child process and wait until it answers (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import httpx

from .protocol import API_KEY_ENV


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``rollout-engines serve`` in a subprocess on a free port of 127.0.0.1.

    The server's API key is ``api_key`` or, without one, a fresh random key (``self.api_key``;
    ``self.headers`` carries it); it reaches the child through ``$ROLLOUT_ENGINES_API_KEY``, never
    its command line (which every local user can read). ``insecure_no_auth=True`` serves without a key.
    Use as a context manager; :meth:`stop` sends SIGTERM (graceful: in-flight requests finish
    within ``--grace-period``) and kills the process if it outlives ``kill_after_s``.
    """

    def __init__(self, backend: str, model: str, *, api_key: str | None = None, options: dict[str, Any] | None = None,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None, log: Path | None = None,
                 host: str = "127.0.0.1", insecure_no_auth: bool = False) -> None:
        self.host, self.port = host, free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.api_key = None if insecure_no_auth else (api_key or secrets.token_urlsafe(32))
        args = [sys.executable, "-m", "rollout_engines_remote.server", "--backend", backend, "--model", model,
                "--host", host, "--port", str(self.port), "--log-level", "warning", *extra_args]
        if insecure_no_auth:
            args.append("--insecure-no-auth")
        for key, value in (options or {}).items():
            args += ["--option", f"{key}={value}"]
        self.args = args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.pop(API_KEY_ENV, None)
        if self.api_key:
            self.env[API_KEY_ENV] = self.api_key
        self.log_path = log
        self._log: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout_s: float = 180.0) -> ServerProcess:
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            out = self._log
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} before it was ready"
                                   + (f"; log: {self.log_path}" if self.log_path else ""))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server at {self.url} not healthy within {timeout_s:.0f} s")

    def stop(self, kill_after_s: float = 60.0) -> int | None:
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(kill_after_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            code = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> ServerProcess:
        # ``with server.start(...)`` and ``with server`` both start exactly one process.
        return self if self.proc is not None and self.proc.poll() is None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
