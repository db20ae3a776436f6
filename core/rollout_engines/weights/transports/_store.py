"""Rendezvous, signalling and liveness over a ``torch.distributed.TCPStore``.

Shared by the transports that need a side channel (``gloo``/``nccl`` group set-up and recovery,
``shm`` and ``cuda_ipc`` ready/ack signalling). The trainer (rank 0) hosts the store on a free
port; receivers connect to it. Every wait here is bounded and checks, about twice a second, that
the peers are still there:

- each receiver runs a :class:`Heartbeat` thread that bumps ``hb/<rank>``; the sender's
  :class:`PeerWatch` names a receiver whose counter stopped moving as dead;
- a receiver that fails mid-update sets ``failed/<rank>`` and bumps ``failures``, so the sender
  stops waiting for it at once instead of at the timeout;
- the sender publishes an abort as ``abort/<token>``; the sender's death closes the store, which
  the receivers' heartbeat threads notice within a beat.

Security: a ``TCPStore`` has no authentication, so every value a member writes through
:class:`SignedStore` carries an HMAC-SHA256 of its key and bytes under a per-session secret that
the sender makes and that reaches receivers inside the ``TransportSpec`` (over the control path
that is already trusted: a pipe, a Ray actor call, the server's authenticated ``/weights/init``).
A value without a valid signature raises :class:`WeightSyncError` naming the key. Only the
counters (heartbeats, the failure count; ``add`` cannot carry a signature) are unsigned: forging
them can delay the detection of a dead peer, never change what is applied. The store listens on
loopback unless the sender is given another address (``options={'host': ...}``, for engines on
other hosts; firewall that port to the engines' hosts, see SECURITY.md).
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import ipaddress
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch.distributed as dist

from ...errors import WeightSyncError

logger = logging.getLogger("rollout_engines.weights")

DEFAULT_HOST = "127.0.0.1"
HEARTBEAT_S = 0.5
DEFAULT_DEAD_AFTER_S = 10.0
CHECK_EVERY_S = 0.5
TRAINER = "trainer (rank 0)"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket bound to exactly ``host`` (a ``TCPStore`` given only a host name listens
    on every interface; handed a socket it listens where the socket does)."""
    family = socket.AF_INET
    try:
        if ipaddress.ip_address(host).version == 6:
            family = socket.AF_INET6
    except ValueError:  # a host name: resolve it to the address it names
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def loopback_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A master ``TCPStore`` that listens on exactly ``host`` (see :func:`_listen`)."""
    sock = _listen(host, port)
    try:
        store = dist.TCPStore(
            host, sock.getsockname()[1], is_master=True, wait_for_workers=False, timeout=_td(timeout_s),
            use_libuv=False, master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def host_store(options: dict[str, Any], timeout_s: float) -> tuple[dist.TCPStore, dict[str, Any]]:
    """Host the session's store on ``options['host']`` (default loopback) and make the session's
    signing secret. Port 0 = the OS picks a free port (no race between pick and bind). The returned
    spec (address, secret, liveness settings) is what receivers need to join."""
    host = str(options.get("host", DEFAULT_HOST))
    try:
        store = loopback_store(host, int(options.get("port", 0)), timeout_s)
    except Exception as exc:
        raise WeightSyncError(
            f"could not host the weight-sync rendezvous store on {host}:{options.get('port', 0)}: {exc}. "
            "Pass options={'host': ADDRESS_REACHABLE_BY_ENGINES, 'port': FREE_PORT}"
        ) from exc
    spec = {
        "host": str(options.get("advertise_host", host)),
        "port": store.port,
        "dead_after_s": float(options.get("dead_after_s", DEFAULT_DEAD_AFTER_S)),
        "secret": secrets.token_hex(32),
    }
    return store, spec


def join_store(options: dict[str, Any], timeout_s: float) -> dist.TCPStore:
    host, port = options["host"], int(options["port"])
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=_td(timeout_s))
    except Exception as exc:
        raise WeightSyncError(
            f"could not reach the trainer's weight-sync store at {host}:{port}: {exc}. "
            "Check that the trainer process is alive and the address is reachable from the engine",
            peer=TRAINER,
        ) from exc


def session_secret(options: dict[str, Any]) -> str:
    """The session's signing secret from a spec's options (receivers refuse to join without it)."""
    secret = options.get("secret")
    if not isinstance(secret, str) or len(secret) < 32:
        raise WeightSyncError(
            "the weight-sync spec carries no signing secret; open sessions with connect_weight_sync(), "
            "which puts the sender's secret in every engine's TransportSpec", peer=TRAINER,
        )
    return secret


#: A value no key of a session holds (every value starts with its signature's hex digits).
_ABSENT = "\0"


class _ClosedStore:
    """Stands in for a closed session's store: every operation says the session is closed."""

    def __getattr__(self, name: str) -> Any:
        raise WeightSyncError("this weight-sync session's store is closed; connect a new session", peer="store")


class SignedStore:
    """One session's view of the store: keys under ``roe/<session>/``, values signed and checked.

    ``set``/``get``/``multi_get`` and the line log (``append_line``/``read_lines``) carry an
    HMAC-SHA256 (first 16 bytes, hex) of key and value; ``check``, ``add`` and ``delete_key`` pass
    through. ``raw`` is the unsigned prefix store (for ``torch.distributed`` rendezvous).
    """

    _MAC = 32  # hex characters of the signature in front of every value

    def __init__(self, store: dist.Store, session_id: str, secret: str) -> None:
        self.raw = dist.PrefixStore(f"roe/{session_id}/", store)
        self._secret = bytes.fromhex(secret)

    def _sign(self, key: str, value: bytes) -> bytes:
        return hmac.digest(self._secret, key.encode() + b"\0" + value, "sha256")[: self._MAC // 2].hex().encode()

    def _open(self, key: str, blob: bytes) -> bytes:
        mac, value = blob[: self._MAC], blob[self._MAC + 1 :]
        if len(blob) <= self._MAC or blob[self._MAC : self._MAC + 1] != b"|" or not hmac.compare_digest(
            mac, self._sign(key, value)
        ):
            raise WeightSyncError(
                f"the weight-sync store value '{key}' is not signed with this weight sync's key; something other than "
                "the trainer and its engines wrote to the store. The update is refused; keep the store "
                "on loopback or firewall its port (SECURITY.md)", peer="store",
            )
        return value

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        self.raw.set(key, self._sign(key, data) + b"|" + data)  # type: ignore[arg-type]  # bytes are accepted

    def get(self, key: str) -> bytes:
        return self._open(key, self.raw.get(key))

    def _peek(self, key: str) -> bytes | None:
        """``key``'s stored bytes, or None if it is not set: one round trip (``get`` waits for the
        key first, a second round trip). A compare-and-set whose expected value no key ever holds
        changes nothing and answers with what is there."""
        blob = self.raw.compare_set(key, _ABSENT, _ABSENT)
        return None if blob == _ABSENT.encode() else blob

    def read(self, key: str) -> bytes | None:
        """``key``'s value, checked, or None if it is not set (one round trip)."""
        blob = self._peek(key)
        return None if blob is None else self._open(key, blob)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._open(k, v) for k, v in zip(keys, self.raw.multi_get(keys), strict=True)]

    def append_line(self, key: str, line: str) -> None:
        """Append one line (no newline inside) to the log under ``key``."""
        data = line.encode()
        self.raw.append(key, self._sign(key, data) + b"|" + data + b"\n")  # type: ignore[attr-defined]

    def read_lines(self, key: str, offset: int) -> tuple[list[str], int]:
        """The lines appended to ``key`` past byte ``offset``, each checked, and the new offset (no
        lines while ``key`` is not set; one round trip either way)."""
        log = self._peek(key)
        if log is None:
            return [], offset
        fresh = log[offset:]
        end = fresh.rfind(b"\n") + 1  # a line still being written is read next time
        lines = [self._open(key, line).decode() for line in fresh[:end].splitlines()]
        return lines, offset + end

    def check(self, keys: list[str]) -> bool:
        return bool(self.raw.check(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self.raw.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return int(self.raw.add(key, amount))

    def delete_key(self, key: str) -> bool:
        return bool(self.raw.delete_key(key))

    def close(self) -> None:
        """Let go of the store: a client's connection closes, and a hosted store stops listening
        once nothing else holds it (a process group built on ``raw`` does). Every later operation
        raises :class:`WeightSyncError`."""
        self.raw = cast(dist.PrefixStore, _ClosedStore())


def session_store(store: dist.Store, session_id: str, secret: str) -> SignedStore:
    return SignedStore(store, session_id, secret)


def poll(
    done: Callable[[], bool],
    *,
    timeout_s: float,
    check: Callable[[], None],
    on_timeout: Callable[[], Exception],
    peer: str = TRAINER,
    bucket: int | None = None,
) -> None:
    """Wait until ``done()`` with a short back-off; ``check()`` (raises on a dead peer) runs twice a
    second; past the timeout ``on_timeout()`` is raised. A broken store connection (its host,
    ``peer``, is gone) becomes a :class:`WeightSyncError` too. It never blocks in the store: a
    TCPStore client logs two warnings each time a blocked wait times out."""
    start = time.monotonic()
    deadline, next_check, nap = start + timeout_s, start + CHECK_EVERY_S, 1e-5
    try:
        while not done():
            now = time.monotonic()
            if now >= next_check:
                check()
                next_check = now + CHECK_EVERY_S
            if now >= deadline:
                raise on_timeout()
            time.sleep(nap)
            # Short naps while the wait is young (a GPU bucket or a whole zero-copy push takes a
            # few milliseconds), then back off so a long wait costs no CPU.
            age = now - start
            nap = min(nap * 2, 5e-5 if age < 0.02 else 2e-4 if age < 0.1 else 2e-3)
    except WeightSyncError:
        raise
    except Exception as exc:
        raise WeightSyncError(f"lost the rendezvous store ({_short(exc)}); {peer} is gone", peer=peer, bucket=bucket) from exc


class Heartbeat:
    """Receiver side: bumps ``hb/<rank>`` every half second on its own store connection, and
    notices when the trainer (which hosts the store) is gone."""

    def __init__(self, options: dict[str, Any], session_id: str, rank: int, timeout_s: float) -> None:
        self._store = session_store(join_store(options, timeout_s), session_id, session_secret(options))
        self._key = f"hb/{rank}"
        self._store.add(self._key, 1)
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"roe-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._store.add(self._key, 1)
            except Exception as exc:  # the store lives in the trainer: it is gone
                self.error = exc
                return

    def check(self) -> None:
        if self.error is not None:
            raise WeightSyncError(f"lost the trainer's rendezvous store ({self.error}); the trainer is gone", peer=TRAINER)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_S)
        self._store.close()  # a beat still in flight ends in an error the stopped thread keeps


class PeerWatch:
    """Sender side: which receivers reported a failure, and which stopped beating."""

    def __init__(
        self, store: SignedStore, ranks: Iterable[int], dead_after_s: float,
        cancelled: Callable[[int | None], None] | None = None,
    ) -> None:
        self.store, self.ranks, self.dead_after_s = store, list(ranks), dead_after_s
        self._cancelled = cancelled
        now = time.monotonic()
        self._beats: dict[int, tuple[int, float]] = {r: (-1, now) for r in self.ranks}
        self.failures_seen = 0
        #: Set: only failures reported for this update count (:func:`report_failure`'s ``token``);
        #: one reported for an earlier update is forgotten, so a new update needs no clearing.
        self.token: str | None = None

    def failures(self) -> int:
        return int(self.store.add("failures", 0))

    def failed_ranks(self) -> dict[int, str]:
        out = {}
        for r in self.ranks:
            value = self.store.read(f"failed/{r}")
            if value is None:
                continue
            token, tab, reason = value.decode(errors="replace").partition("\t")
            if not tab:
                token, reason = "", token
            if self.token is None or not token or token == self.token:
                out[r] = _printable(reason)
        return out

    def dead_ranks(self) -> list[int]:
        now, dead = time.monotonic(), []
        for r in self.ranks:
            count = int(self.store.add(f"hb/{r}", 0))
            last, since = self._beats[r]
            if count != last:
                self._beats[r] = (count, now)
            elif now - since > self.dead_after_s:
                dead.append(r)
        return dead

    def check(self, bucket: int | None) -> None:
        """Raise :class:`WeightSyncError` naming a receiver that failed or died (or, first, the
        sender's own cancellation)."""
        if self._cancelled is not None:
            self._cancelled(bucket)
        count = self.failures()
        if count != self.failures_seen:
            failed = self.failed_ranks()
            if failed:
                rank, reason = next(iter(failed.items()))
                raise WeightSyncError(f"receiver rank {rank} gave up: {reason}", peer=f"rank {rank}", bucket=bucket)
            if self.token is not None:  # reports of earlier updates only: seen (each report sets, then counts)
                self.failures_seen = count
        dead = self.dead_ranks()
        if dead:
            raise WeightSyncError(
                f"receiver rank {dead[0]} stopped responding (no heartbeat for {self.dead_after_s:.0f} s)",
                peer=f"rank {dead[0]}", bucket=self.next_bucket(dead[0], bucket),
            )

    def next_bucket(self, rank: int, default: int | None) -> int | None:
        """The bucket ``rank`` was waiting for (it publishes ``got/<rank>`` after each one)."""
        key = f"got/{rank}"
        if self.store.check([key]):
            return int(self.store.get(key)) + 1
        return default

    def culprit(self, bucket: int | None, cause: BaseException, transport: str) -> WeightSyncError:
        """After a wire error: give the peers a few beats to show which one failed, then name it."""
        deadline = time.monotonic() + self.dead_after_s + 2 * HEARTBEAT_S
        while time.monotonic() < deadline:
            try:
                self.check(bucket)
            except WeightSyncError as exc:
                exc.args = (f"{transport}: {exc.args[0]} ({_short(cause)})",)
                return exc
            time.sleep(HEARTBEAT_S / 2)
        return WeightSyncError(f"{transport}: send failed: {_short(cause)}", peer="a receiver", bucket=bucket)

    def clear(self) -> None:
        """Forget reported failures (after the group was rebuilt)."""
        for r in self.ranks:
            self.store.delete_key(f"failed/{r}")
        self.failures_seen = self.failures()


@contextlib.contextmanager
def trainer_link(bucket: int | None) -> Iterator[None]:
    """Receiver side: a store operation that fails means the trainer (its host) is gone."""
    try:
        yield
    except WeightSyncError:
        raise
    except (RuntimeError, OSError) as exc:
        raise WeightSyncError(f"lost the trainer's rendezvous store ({_short(exc)})", peer=TRAINER, bucket=bucket) from exc


def report_progress(store: SignedStore, rank: int, index: int) -> None:
    """Receiver side: bucket ``index`` arrived (names the right bucket if this rank dies next)."""
    store.set(f"got/{rank}", str(index))


def report_failure(store: SignedStore, rank: int, reason: str, token: str = "") -> None:
    """Receiver side: tell the sender this rank gave up on the current update (best effort);
    ``token``: that update's (a sender that tracks tokens ignores reports of earlier updates)."""
    try:
        store.set(f"failed/{rank}", f"{token}\t{reason[:500]}" if token else reason[:500])
        store.add("failures", 1)
    except Exception:  # the store is the trainer's: if it is gone there is nobody to tell
        logger.debug("could not report the failure of rank %d", rank, exc_info=True)


def raise_if_aborted(store: SignedStore, key: str, kind: str, bucket: int | None) -> None:
    """Raise the receiver's WeightSyncError if the trainer posted an abort under ``key``."""
    if store.check([key]):
        reason = _printable(store.get(key).decode(errors="replace"))
        raise WeightSyncError(f"{kind}: the trainer aborted the update: {reason}", peer=TRAINER, bucket=bucket)


def _short(exc: BaseException) -> str:
    text = str(exc).split(". This is typically")[0]
    return f"{type(exc).__name__}: {text[:300]}"


def _printable(text: str, limit: int = 500) -> str:
    """A peer's free-text reason as one bounded line of printable characters."""
    return "".join(c if c.isprintable() else " " for c in text[:limit])
