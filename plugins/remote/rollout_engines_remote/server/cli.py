"""``rollout-engines serve``: the command line (the API key's sources, the parser, ``main``) and
the uvicorn server that drains in-flight requests on SIGTERM/SIGINT and exits 0."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import math
import os
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rollout_engines.options import add_option_argument, merge_options, split_engine_kwargs

from ..protocol import API_KEY_ENV
from .app import create_app
from .guard import allowed_hosts_for
from .limits import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BUCKET_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
)
from .routes import DEFAULT_PROTOCOLS, PROTOCOLS, check_protocols

logger = logging.getLogger("rollout_engines.remote.server")


# ---- the API key on the command line: from a file, the environment, or made and written ---------
class KeyFileError(RuntimeError):
    """An API key file that cannot be used safely."""


def default_key_file(port: int) -> Path:
    """Where ``serve`` writes the key it generates: ``$XDG_RUNTIME_DIR/rollout-engines/serve-PORT.key``
    (a per-user folder), else ``~/.cache/rollout-engines/serve-PORT.key``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and os.path.isdir(runtime) else Path.home() / ".cache"
    return base / "rollout-engines" / f"serve-{port}.key"


def write_key_file(path: Path, key: str) -> None:
    """Write ``key`` to ``path``, readable and writable by this user only (mode 0600). The file is
    created under a fresh random name with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (so nobody can have
    opened or linked it before) and then renamed over ``path``."""
    parent = path.parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(parent)
    sticky = bool(st.st_mode & 0o1000)
    if st.st_uid not in (os.getuid(), 0) or (st.st_mode & 0o022 and not sticky):
        raise KeyFileError(f"{parent} is writable by other users; pass --api-key-file with a path in a folder only "
                           "you can write")
    tmp = parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.write(fd, key.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_key_file(path: Path) -> str:
    """The key in ``path`` (surrounding white space removed). The file must belong to this user (or
    root); one that other users can read is used with a warning."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise KeyFileError(f"cannot read the API key file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid not in (os.getuid(), 0):
            raise KeyFileError(f"the API key file {path} belongs to another user; use a file you own (mode 0600)")
        if st.st_mode & 0o077:
            logger.warning("the API key file %s can be read by other users; chmod 600 it", path)
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    key = data.decode("utf-8", "replace").strip()
    if not key or len(data) > 4096 or any(c.isspace() for c in key):
        raise KeyFileError(f"the API key file {path} must hold one key (1 to 4096 characters, no spaces)")
    return key


def resolve_api_key(ns: argparse.Namespace) -> tuple[str | None, Path | None]:
    """The server's key from the command line and environment, and the path of the file this call
    wrote (to remove at exit; ``None`` when it wrote none). Order: ``--api-key``,
    ``--api-key-file`` (read; made with a new key when it does not exist), ``$ROLLOUT_ENGINES_API_KEY``,
    else a new key written to :func:`default_key_file`."""
    env_key = os.environ.get(API_KEY_ENV) or None
    if ns.insecure_no_auth:
        if ns.api_key or ns.api_key_file:
            raise KeyFileError("--insecure-no-auth turns the API key off: do not also pass --api-key/--api-key-file")
        if env_key:
            logger.warning("%s is set but ignored: --insecure-no-auth turns authentication off", API_KEY_ENV)
        return None, None
    if ns.api_key:
        logger.warning("--api-key is visible to every user of this machine (ps, /proc); prefer --api-key-file or "
                       "$%s", API_KEY_ENV)
        return ns.api_key, None
    if ns.api_key_file:
        path = Path(ns.api_key_file).expanduser()
        if os.path.lexists(path):
            return read_key_file(path), None
        key = secrets.token_urlsafe(32)
        write_key_file(path, key)
        _announce_key_file(path)
        return key, None
    if env_key:
        return env_key, None
    path = default_key_file(ns.port)
    key = secrets.token_urlsafe(32)
    write_key_file(path, key)
    _announce_key_file(path)
    return key, path


def _announce_key_file(path: Path) -> None:
    message = (f"API key written to {path} (mode 0600). Clients: create_engine('remote', ..., "
               f"api_key_file='{path}') or {API_KEY_ENV}=$(cat {path})")
    logger.warning("%s", message)


class AcceptErrorFilter(logging.Filter):
    """Lets one accept error ("Too many open files" and the like) through per ``every_s`` seconds;
    the rest are counted and the count is added to the next one that passes. Other records pass."""

    ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

    def __init__(self, every_s: float = 10.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last = -math.inf
        self._dropped = 0
        self._lock = threading.Lock()

    def _is_accept_error(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OSError) and exc.errno in self.ERRNOS:
            return True
        text = record.getMessage().lower()
        return "too many open files" in text or "socket.accept()" in text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._is_accept_error(record):
            return True
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._dropped += 1
                return False
            self._last, dropped, self._dropped = now, self._dropped, 0
        if dropped:
            record.msg = f"{record.getMessage()} ({dropped} more like it in the last {self.every_s:g} s not logged)"
            record.args = ()
        return True


def install_accept_error_filter(every_s: float = 10.0) -> AcceptErrorFilter:
    """Rate-limit accept-error logging (asyncio's and uvicorn's) so a file-descriptor flood cannot
    flood the log too."""
    flt = AcceptErrorFilter(every_s)
    for name in ("uvicorn.error", "asyncio"):
        logging.getLogger(name).addFilter(flt)
    return flt


# ---- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-engines serve", description="Serve an engine of any installed backend over HTTP.")
    p.add_argument("--backend", default="transformers", help="backend name (see `rollout-engines backends`)")
    p.add_argument("--model", required=True, help="model path")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from PATH (made, mode 0600, with a new key if it does not exist)")
    p.add_argument("--api-key", default=None,
                   help=f"the API key itself; visible to every local user in ps: prefer --api-key-file or ${API_KEY_ENV}. "
                        "With no key given, one is generated and written to "
                        "$XDG_RUNTIME_DIR/rollout-engines/serve-PORT.key (else ~/.cache/rollout-engines/...)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve without an API key: anyone who can reach the port can push weights")
    p.add_argument("--allowed-hosts", default="", metavar="A,B",
                   help="more Host header names to answer to, besides loopback names and --host; '*': any")
    p.add_argument("--weights-root", default=None, metavar="DIR",
                   help="allow disk weight transfers and /v1/load_lora_adapter from folders under DIR (without "
                        "it they are refused)")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help="requests handled at once; beyond, 503 with Retry-After")
    p.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT_S, metavar="SECONDS",
                   help="a request body must arrive within this time (408 otherwise)")
    p.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S, metavar="SECONDS",
                   help="close idle keep-alive connections after this many seconds")
    add_option_argument(p, help="engine option (EngineConfig field or backend option)")
    p.add_argument("--factory", default=None, metavar="MODULE:CLASS",
                   help="serve an engine class that is not a registered backend (tests, benchmarks)")
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models (default: --model)")
    p.add_argument("--protocols", default=",".join(DEFAULT_PROTOCOLS), metavar="A,B",
                   help=f"APIs to serve, from: {', '.join(PROTOCOLS)} (native: /generate, /generate/stream, /abort, "
                        "control plane and weight sync; openai: /v1/*). /info, /health and /metrics always")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--max-bucket-bytes", type=int, default=DEFAULT_MAX_BUCKET_BYTES)
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown before they are aborted")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``rollout-engines serve ...``: start the engine, then serve it until SIGINT/SIGTERM."""
    import uvicorn
    from rollout_engines.factory import create_engine

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        args = args[1:]
    parser = build_parser()
    ns = parser.parse_args(args)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_accept_error_filter()
    if ns.max_concurrency < 1 or ns.body_read_timeout <= 0 or ns.timeout_keep_alive < 1:
        parser.error("--max-concurrency, --body-read-timeout and --timeout-keep-alive must be positive")
    allowed = [h for h in ns.allowed_hosts.split(",") if h.strip()]
    try:
        allowed_hosts_for(ns.host, allowed)
    except ValueError as exc:
        parser.error(f"--allowed-hosts: {exc}")
    try:
        protocols = check_protocols(ns.protocols.split(","))
    except ValueError as exc:
        parser.error(f"--protocols: {exc}")
    if ns.weights_root is not None and not os.path.isdir(ns.weights_root):
        parser.error(f"--weights-root {ns.weights_root} is not an existing folder")
    try:
        api_key, written = resolve_api_key(ns)
    except (KeyFileError, OSError) as exc:
        parser.error(str(exc))
    options = merge_options(ns.option)
    logger.info("starting a '%s' engine on %s", ns.backend, ns.model)
    try:
        if ns.factory:
            from rollout_engines.plugins import _import_target
            from rollout_engines.types import EngineConfig

            fields, backend_options = split_engine_kwargs(options)
            config = EngineConfig(backend=ns.backend, model=ns.model, options=backend_options, **fields)
            engine = _import_target(ns.factory)(config)
        else:
            engine = create_engine(ns.backend, model=ns.model, **options)
        app = create_app(engine, api_key=api_key, insecure_no_auth=ns.insecure_no_auth, allowed_hosts=allowed,
                         bind_host=ns.host, weights_root=ns.weights_root, max_concurrency=ns.max_concurrency,
                         body_read_timeout_s=ns.body_read_timeout, max_body_bytes=ns.max_body_bytes,
                         max_bucket_bytes=ns.max_bucket_bytes, model_name=ns.served_model_name,
                         close_timeout_s=ns.grace_period, exit_process_on_close_timeout=True,
                         protocols=protocols)
        # The Guard answers typed 503s beyond --max-concurrency requests; uvicorn's own (plain) 503
        # bounds open connections, idle keep-alive ones included, at twice that.
        uv_config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(), lifespan="on",
                                timeout_graceful_shutdown=ns.grace_period, access_log=False, backlog=4096,
                                limit_concurrency=max(2 * ns.max_concurrency, ns.max_concurrency + 64),
                                timeout_keep_alive=ns.timeout_keep_alive)
        server = _graceful_server_class()(uv_config)
        server.run()
    finally:
        if written is not None:
            _remove_key_file(written, api_key)
    logger.info("server stopped")
    return 0


def _remove_key_file(path: Path, key: str | None) -> None:
    """Remove the key file this server wrote, unless another server has written its own there since."""
    with contextlib.suppress(OSError, KeyFileError):
        if read_key_file(path) == key:
            path.unlink()


def _graceful_server_class() -> type:
    import signal
    import threading

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown, so the process dies of the signal;
        a server that drained cleanly should exit 0 instead."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer
