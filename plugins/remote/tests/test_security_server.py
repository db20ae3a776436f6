"""The server's defences, against real uvicorn servers on 127.0.0.1 and the transformers engine on the
tiny model: a key required by default (generated into a 0600 file when none is given), the Host
check against DNS rebinding, ``disk`` paths confined to ``--weights-root``, ``top_k`` limits, work
cancelled when its client disconnects, the concurrency limit, body-read timeouts, one weight-sync
init at a time, and rate-limited accept-error logs."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import rollout_engines as roe
from rollout_engines_remote.launch import ServerProcess, free_port
from rollout_engines_remote.protocol import API_KEY_ENV, RemoteForbidden
from rollout_engines_remote.server import (
    LOOPBACK_HOSTS,
    AcceptErrorFilter,
    KeyFileError,
    allowed_hosts_for,
    build_parser,
    create_app,
    host_name,
    resolve_api_key,
    write_key_file,
)

from .conftest import API_KEY, ThreadServer, outstanding, start_thread_server, wait_until

pytestmark = pytest.mark.remote

VOCAB = 4096  # the tiny model's
LONG = {"prompt_token_ids": [[1, 2, 3]] * 8, "sampling": {"temperature": 0, "max_tokens": 1900, "ignore_eos": True}}
SHORT = {"prompt_token_ids": [[5, 6]], "sampling": {"temperature": 0, "max_tokens": 4}}


def assert_typed_error(r: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == kind and set(error) >= {"type", "message", "param"}
    return error


@pytest.fixture
def side_server(thread_server: ThreadServer) -> Iterator[Any]:
    """Start more servers over the module's engine (never closing it), each stopped after the test."""
    started: list[ThreadServer] = []

    def start(**kwargs: Any) -> ThreadServer:
        kwargs.setdefault("close_engine", False)
        server = start_thread_server(thread_server.engine, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# ---- the key -------------------------------------------------------------------------------------
def test_create_app_refuses_to_serve_without_a_key_unless_told(thread_server, side_server, caplog):
    with pytest.raises(ValueError, match=r"api_key=.*insecure_no_auth=True"):
        create_app(thread_server.engine)
    with pytest.raises(ValueError, match="not both"):
        create_app(thread_server.engine, api_key="k", insecure_no_auth=True)
    with caplog.at_level(logging.WARNING, logger="rollout_engines.remote.server"):
        open_server = side_server(api_key=None, insecure_no_auth=True)
    assert "WITHOUT authentication" in caplog.text
    assert httpx.get(open_server.url + "/info", timeout=30).status_code == 200
    # The module's server, made with a key, still refuses a request without it.
    assert_typed_error(httpx.get(thread_server.url + "/info", timeout=30), 401, "Unauthorized")


def parse(*argv: str) -> Any:
    return build_parser().parse_args(["--model", "m", *argv])


def test_key_sources_and_the_generated_key_file(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    # Nothing given: a new key, written 0600 to the default place; a new one at every start.
    key, written = resolve_api_key(parse("--port", "8123"))
    assert written == runtime / "rollout-engines" / "serve-8123.key"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert written.read_text().strip() == key and len(key) >= 32
    key2, _ = resolve_api_key(parse("--port", "8123"))
    assert key2 != key and written.read_text().strip() == key2
    assert not [p for p in written.parent.iterdir() if p.name.endswith(".tmp")]
    # The environment, when set, is used as it is.
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(parse()) == ("from-env", None)
    # A named file that exists is read; one that does not is made (0600) with a new key.
    named = tmp_path / "k"
    named.write_text("from-file\n")
    named.chmod(0o600)
    assert resolve_api_key(parse("--api-key-file", str(named))) == ("from-file", None)
    fresh = tmp_path / "fresh.key"
    key3, _ = resolve_api_key(parse("--api-key-file", str(fresh)))
    assert fresh.read_text().strip() == key3 and stat.S_IMODE(fresh.stat().st_mode) == 0o600
    with pytest.raises(KeyFileError, match="insecure-no-auth"):
        resolve_api_key(parse("--insecure-no-auth", "--api-key-file", str(named)))
    assert resolve_api_key(parse("--insecure-no-auth")) == (None, None)
    # A folder other users can write is refused for a key file.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(KeyFileError, match="writable by other users"):
        write_key_file(shared / "x.key", "k")


def proc_listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.append(address)
    return found


def test_serve_without_a_key_generates_one_into_a_private_file(tiny_model, tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    server = ServerProcess("transformers", str(tiny_model), log=tmp_path / "log",
                           env={"XDG_RUNTIME_DIR": str(runtime)},
                           extra_args=["--allowed-hosts", "rollout.test", "--max-concurrency", "3"])
    server.env.pop(API_KEY_ENV)  # no key at all: the server makes one
    server.api_key = None
    key_file = runtime / "rollout-engines" / f"serve-{server.port}.key"
    with server:
        assert server.proc is not None
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        assert len(key) >= 32
        assert proc_listeners(server.port) == ["0100007F"]  # 127.0.0.1 only
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert_typed_error(c.post("/weights/close"), 401, "Unauthorized")
            assert_typed_error(c.post("/weights/init", json={"transport": "disk", "session_id": "x",
                                                             "options": {"path": "/tmp"}}), 401, "Unauthorized")
            assert_typed_error(c.post("/sleep", json={}), 401, "Unauthorized")
            auth = {"authorization": f"Bearer {key}"}
            assert c.get("/info", headers=auth).status_code == 200
            assert c.get("/info", headers={**auth, "host": "rollout.test"}).status_code == 200
            assert_typed_error(c.get("/info", headers={**auth, "host": "evil.example"}), 421, "MisdirectedRequest")
        engine = roe.create_engine("remote", model=server.url, api_key_file=str(key_file))
        try:
            outs = await_sync(engine.generate(roe.GenerateRequest(prompt_token_ids=[[1, 2]])))
            assert len(outs) == 1
        finally:
            await_sync(engine.close())
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline
    log = (tmp_path / "log").read_text()
    assert str(key_file) in log and key not in log
    assert not key_file.exists()  # removed at exit


def await_sync(coro: Any) -> Any:
    return asyncio.run(coro)


def test_serve_keys_from_a_file_or_the_environment_stay_out_of_ps(tiny_model, tmp_path):
    key_file = tmp_path / "server.key"
    key_file.write_text("file-key-0123456789abcdef\n")
    key_file.chmod(0o600)
    server = ServerProcess("transformers", str(tiny_model), log=tmp_path / "log", api_key="file-key-0123456789abcdef",
                           extra_args=["--api-key-file", str(key_file)])
    server.env[API_KEY_ENV] = "an-environment-key-that-loses"  # the named file wins
    with server:
        assert server.proc is not None
        assert b"file-key" not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert httpx.get(server.url + "/info", headers=server.headers, timeout=60).status_code == 200
        r = httpx.get(server.url + "/info", headers={"authorization": "Bearer an-environment-key-that-loses"},
                      timeout=60)
        assert_typed_error(r, 401, "Unauthorized")
    # ServerProcess's own key travels in the environment, not the command line.
    server = ServerProcess("transformers", str(tiny_model), log=tmp_path / "log2")
    assert server.api_key and server.api_key not in " ".join(server.args)
    assert server.env[API_KEY_ENV] == server.api_key


def test_serve_insecure_no_auth_warns_at_start(tiny_model, tmp_path):
    with ServerProcess("transformers", str(tiny_model), log=tmp_path / "log", insecure_no_auth=True) as server:
        assert server.api_key is None
        assert httpx.get(server.url + "/info", timeout=60).status_code == 200
    assert "WITHOUT authentication" in (tmp_path / "log").read_text()


async def test_client_rereads_its_key_file_when_the_server_has_a_new_key(thread_server, side_server, tmp_path):
    key_file = tmp_path / "k"
    key_file.write_text("first-key-abcdefgh")
    port = free_port()
    first = side_server(api_key="first-key-abcdefgh", port=port)
    engine = roe.create_engine("remote", model=first.url, api_key_file=str(key_file), retries=3, backoff_s=0.05)
    try:
        assert len(await engine.generate(roe.GenerateRequest(prompt_token_ids=[[1]]))) == 1
        first.stop()
        side_server(api_key="second-key-abcdefgh", port=port)  # "restarted", with a new key
        key_file.write_text("second-key-abcdefgh")
        assert await engine.health()  # a GET (retried) renews the pooled connection
        assert len(await engine.generate(roe.GenerateRequest(prompt_token_ids=[[1]]))) == 1
    finally:
        await engine.close()


# ---- the Host header -------------------------------------------------------------------------------
def test_host_header_must_name_this_server(thread_server):
    port = thread_server.url.rsplit(":", 1)[1]
    with httpx.Client(base_url=thread_server.url, headers=thread_server.headers, timeout=30) as c:
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST", "127.0.0.1", "::1",
                     "localhost."):
            assert c.get("/info", headers={"host": host}).status_code == 200, host
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil",
                     f"attacker@127.0.0.1:{port}", "127.0.0.2", "[::1]x", ""):
            error = assert_typed_error(c.get("/info", headers={"host": host}), 421, "MisdirectedRequest")
            assert error["param"] == "host" and "--allowed-hosts" in error["message"]
        # Before auth, and /health too: a rebinding page learns nothing.
        r = httpx.get(thread_server.url + "/health", headers={"host": "evil.example"}, timeout=30)
        assert_typed_error(r, 421, "MisdirectedRequest")
        r = httpx.post(thread_server.url + "/weights/close", headers={"host": "evil.example"}, timeout=30)
        assert_typed_error(r, 421, "MisdirectedRequest")


def test_allowed_hosts_extend_or_disable_the_check(side_server):
    named = side_server(allowed_hosts=["rollout.internal", "10.1.2.3"])
    wide = side_server(allowed_hosts=["*"])
    for server, host, status in ((named, "rollout.internal:80", 200), (named, "10.1.2.3", 200),
                                 (named, "evil.example", 421), (wide, "evil.example", 200)):
        r = httpx.get(server.url + "/info", headers={**server.headers, "host": host}, timeout=30)
        assert r.status_code == status, (host, r.text)
    with pytest.raises(ValueError, match="not a host name"):
        allowed_hosts_for("127.0.0.1", ["http://x/"])


def test_a_server_bound_to_one_address_answers_to_it(side_server):
    server = side_server(host="127.0.0.2")
    port = server.url.rsplit(":", 1)[1]
    for host, status in ((f"127.0.0.2:{port}", 200), (f"localhost:{port}", 200), ("127.0.0.3", 421)):
        r = httpx.get(server.url + "/info", headers={**server.headers, "host": host}, timeout=30)
        assert r.status_code == status, (host, r.text)
    wildcard = allowed_hosts_for("0.0.0.0")
    assert wildcard is not None and LOOPBACK_HOSTS <= wildcard
    assert host_name(socket.gethostname()) in wildcard
    assert allowed_hosts_for("10.0.0.7") == LOOPBACK_HOSTS | {"10.0.0.7"}
    assert host_name("[0:0:0:0:0:0:0:1]:80") == "::1" and host_name("a b") is None


# ---- disk paths --------------------------------------------------------------------------------------
def disk_spec(path: str) -> dict[str, Any]:
    return {"transport": "disk", "session_id": "s", "options": {"path": path}}


def test_disk_transfers_need_a_weights_root(thread_server, tmp_path):
    r = httpx.post(thread_server.url + "/weights/init", json=disk_spec(str(tmp_path)), headers=thread_server.headers,
                   timeout=30)
    error = assert_typed_error(r, 403, "Forbidden")
    assert "--weights-root" in error["message"]


async def test_disk_paths_stay_inside_the_weights_root(side_server, tmp_path, tiny_model):
    root = tmp_path / "root"
    (root / "updates").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("TOP-SECRET-CONTENT")
    (root / "secret.txt").write_text("TOP-SECRET-CONTENT")
    (root / "link").symlink_to(outside)
    server = side_server(weights_root=str(root))
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as c:
        for path in (str(outside), str(root / ".." / "outside"), str(root / "link"), "../outside",
                     str(root / "link" / "secret.txt"), "/etc"):
            r = c.post("/weights/init", json=disk_spec(path))
            error = assert_typed_error(r, 403, "Forbidden")
            assert "weights root" in error["message"] and "TOP-SECRET" not in r.text
        for path in (str(root / "missing"), str(root / "secret.txt"), ""):
            r = c.post("/weights/init", json=disk_spec(path))
            error = assert_typed_error(r, 422, "ValidationError")
            assert error["param"] == "options.path" and "TOP-SECRET" not in r.text
    # A folder inside the root works, end to end, through the remote backend.
    engine = roe.create_engine("remote", model=server.url, api_key=server.api_key, transports=["disk"])
    try:
        from transformers import AutoModelForCausalLM

        weights = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(str(tiny_model)).named_parameters()}
        version = engine.weight_version + 1
        async with await roe.connect_weight_sync([engine], transport="disk", options={"path": str(root / "updates")},
                                                 timeout_s=60) as sync:
            assert await sync.push(weights, version=version) == version
        assert (await engine.info()).weight_version == version
    finally:
        await engine.close()


# ---- per-request limits ----------------------------------------------------------------------------
async def test_huge_top_k_is_422_and_requests_beside_it_succeed(thread_server):
    good = {
        "/generate": {"prompt_token_ids": [[3, 4, 5]], "sampling": {"max_tokens": 4, "top_k": 20}},
        "/v1/completions": {"prompt": [3, 4, 5], "max_tokens": 4, "top_k": 20},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_k": 20},
    }

    def with_top_k(path: str, top_k: int) -> dict[str, Any]:
        body = json.loads(json.dumps(good[path]))
        (body["sampling"] if path == "/generate" else body)["top_k"] = top_k
        return body

    async with httpx.AsyncClient(base_url=thread_server.url, headers=thread_server.headers, timeout=120) as c:
        for path in good:
            calls = [c.post(path, json=good[path]) for _ in range(10)]
            calls.insert(5, c.post(path, json=with_top_k(path, 2**64)))
            responses = await asyncio.gather(*calls)
            bad = responses.pop(5)
            error = assert_typed_error(bad, 422, "ValidationError")
            assert error["param"].endswith("top_k"), error
            assert [r.status_code for r in responses] == [200] * 10, [r.text for r in responses if r.status_code != 200]
            r = await c.post(path, json=with_top_k(path, VOCAB + 1))
            assert "vocabulary" in assert_typed_error(r, 422, "ValidationError")["message"]
            assert (await c.post(path, json=with_top_k(path, VOCAB))).status_code == 200


# ---- cancelled on disconnect, concurrency limit, body-read timeouts ----------------------------------
async def test_a_disconnected_clients_generation_is_cancelled(thread_server):
    # The client goes once the engine runs the request (a fixed client timeout raced the engine's
    # speed: 8 x 1900 tokens take ~6 s on the tiny model here, less on a quicker machine).
    async with httpx.AsyncClient(base_url=thread_server.url, headers=thread_server.headers, timeout=120) as c:
        long = asyncio.ensure_future(c.post("/generate", json=LONG))
        await asyncio.to_thread(wait_until, lambda: outstanding(thread_server) >= 1, 30, "the long generate to run")
        long.cancel()  # closes the connection
        await asyncio.gather(long, return_exceptions=True)
    assert long.cancelled()
    await asyncio.to_thread(wait_until, lambda: outstanding(thread_server) == 0, 10,
                            "the cancelled generate to leave the engine")
    start = time.monotonic()
    r = httpx.post(thread_server.url + "/generate", json=SHORT, headers=thread_server.headers, timeout=60)
    assert r.status_code == 200 and time.monotonic() - start < 15
    metrics = httpx.get(thread_server.url + "/metrics", headers=thread_server.headers, timeout=30).text
    assert 'rollout_requests_total{endpoint="/generate",status="499"}' in metrics


async def test_requests_beyond_max_concurrency_get_503(thread_server, side_server):
    server = side_server(max_concurrency=2)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:
        long = [asyncio.ensure_future(c.post("/generate", json=LONG)) for _ in range(2)]
        await asyncio.to_thread(wait_until, lambda: outstanding(thread_server) >= 2, 30, "two long generates")
        r = await c.post("/generate", json=SHORT)
        error = assert_typed_error(r, 503, "Overloaded")
        assert r.headers["retry-after"] == "1" and "--max-concurrency" in error["message"]
        assert (await c.get("/health")).status_code == 200
        for task in long:
            task.cancel()
        await asyncio.gather(*long, return_exceptions=True)
    await asyncio.to_thread(wait_until, lambda: outstanding(thread_server) == 0, 15, "the long generates to end")
    r = httpx.post(server.url + "/generate", json=SHORT, headers=server.headers, timeout=60)
    assert r.status_code == 200


def raw_request(url: str, head: bytes, body_part: bytes, read_timeout_s: float = 20.0) -> tuple[bytes, float]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout_s) as s:
        start = time.monotonic()
        s.sendall(head + body_part)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data, time.monotonic() - start


@pytest.mark.parametrize(("path", "part"), [
    ("/generate", b'{"prompt_token_ids": [[1'),
    ("/weights/bucket", (64).to_bytes(8, "little") + b'{"__metadata__"'),
])
def test_a_body_that_stops_arriving_gets_408(side_server, path, part):
    server = side_server(body_read_timeout_s=1.0)
    port = server.url.rsplit(":", 1)[1]
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n").encode()
    data, seconds = raw_request(server.url, head, part)
    assert data.startswith(b"HTTP/1.1 408"), data[:300]
    error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "RequestTimeout" and "--body-read-timeout" in error["message"]
    assert 0.9 < seconds < 10
    if path == "/generate":  # chunked, stopping mid-way: the same
        head = head.replace(b"Content-Length: 5000", b"Transfer-Encoding: chunked")
        data, seconds = raw_request(server.url, head, b"5\r\n{\"pro\r\n")
        assert data.startswith(b"HTTP/1.1 408"), data[:300]
        assert 0.9 < seconds < 10
    assert httpx.post(server.url + "/generate", json=SHORT, headers=server.headers, timeout=60).status_code == 200


# ---- one weight-sync init at a time ----------------------------------------------------------------
async def test_a_second_weights_init_while_one_is_in_progress_is_409(thread_server):
    from rollout_engines.weights.transports.broadcast import GlooSender

    # A real trainer side that hosts the rendezvous store but does not join the group yet: the
    # server's init waits for it (as it would for a trainer that never answers).
    sender = await asyncio.to_thread(GlooSender, session_id="busy", world_size=2, timeout_s=60, options={})
    spec = {"transport": "gloo", "session_id": "busy", "rank_offset": 1, "world_size": 2, "timeout_s": 60,
            "options": sender.spec_options()}
    try:
        async with httpx.AsyncClient(base_url=thread_server.url, headers=thread_server.headers, timeout=120) as c:
            first = asyncio.ensure_future(c.post("/weights/init", json=spec))
            await asyncio.sleep(1.0)
            assert not first.done()
            start = time.monotonic()
            more = await asyncio.gather(*(c.post("/weights/init", json=spec) for _ in range(8)))
            for r in more:
                error = assert_typed_error(r, 409, "InitInProgress")
                assert "in progress" in error["message"] and "retry" in error["message"]
            # Generation is not held up by the pending init.
            assert (await c.post("/generate", json=SHORT)).status_code == 200
            assert time.monotonic() - start < 15
            assert not first.done()
            await asyncio.to_thread(sender.connect)  # the trainer joins: the first init completes
            r = await asyncio.wait_for(first, 60)
            assert r.status_code == 200, r.text
            assert (await c.post("/weights/close")).status_code == 200
    finally:
        await asyncio.to_thread(sender.close)


# ---- logs --------------------------------------------------------------------------------------------
def test_accept_errors_are_logged_at_most_once_per_interval():
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("rollout_engines.tests.accept_errors")
    log.propagate = False
    handler = Keep()
    log.addHandler(handler)
    flt = AcceptErrorFilter(every_s=0.5)
    log.addFilter(flt)
    try:
        for _ in range(20):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                log.exception("socket.accept() out of system resource")
        log.error("something else")
        assert [r.getMessage() for r in records] == ["socket.accept() out of system resource", "something else"]
        time.sleep(0.6)
        log.error("accept failed: [Errno 24] Too many open files")
        assert "19 more like it" in records[-1].getMessage()
    finally:
        log.removeHandler(handler)
        log.removeFilter(flt)


def test_remote_client_reports_a_forbidden_disk_transfer(thread_server, tmp_path):
    engine = roe.create_engine("remote", model=thread_server.url, api_key=thread_server.api_key)

    async def go() -> None:
        try:
            with pytest.raises(RemoteForbidden, match="--weights-root"):
                await engine.init_weight_transfer(roe.TransportSpec(transport="disk", session_id="s",
                                                                    options={"path": str(tmp_path)}))
        finally:
            await engine.close()

    asyncio.run(go())

