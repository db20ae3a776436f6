"""The ``http`` weight transport: buckets POSTed to rollout-engines servers.

Trainer side (:class:`HttpSender`): every bucket is one ``POST /weights/bucket`` per server whose
body is a safetensors file holding one flat ``U8`` tensor (the bucket, laid out as the manifest
says) and, in its metadata, the session, the update, the bucket index and its checksum. Bucket
``i`` is in flight while the trainer packs bucket ``i+1`` (two buffers, as the core's session
uses them).

Server side (:class:`HttpIngress`): the server relays each arriving bucket, in order, through a
transport the served engine receives over locally (``inproc`` for an engine in the server's
process, else ``shm`` / ``disk``), so manifest validation, checksums, atomic apply and versioning
are the core's :class:`~rollout_engines.weights.receiver.WeightReceiver`'s, unchanged.

The trainer learns the servers of a session from the ``remote`` engines it connected: each one
registers its URL under the session id when its server accepted ``/weights/init``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import logging
import queue
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from rollout_engines.errors import CapabilityError, WeightSyncError
from rollout_engines.weights.buckets import BucketHeader, checksum
from rollout_engines.weights.manifest import TransportSpec, WeightManifest
from rollout_engines.weights.transports.base import TransportSender
from rollout_engines.weights.transports.inproc import InprocReceiver, InprocSender

from .api_client import KEEPALIVE_EXPIRY_S

if TYPE_CHECKING:
    from rollout_engines.engine import Engine

logger = logging.getLogger("rollout_engines.remote.transport")

FRAME_TENSOR = "bucket"
MAX_FRAME_HEADER = 64 * 1024
#: Preference order of local transports the server relays ``http`` buckets through (``http`` and
#: ``inproc`` are queues in the server's process; ``shm``/``disk`` reach worker processes).
RELAY_PREFERENCE = ("http", "inproc", "shm", "disk")


# ---- the frame ---------------------------------------------------------------------------------
def frame_prefix(meta: dict[str, str], nbytes: int) -> bytes:
    """The safetensors header (length + JSON) of a one-tensor file holding ``nbytes`` of U8."""
    header = {"__metadata__": meta, FRAME_TENSOR: {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def parse_frame_header(raw: bytes) -> tuple[dict[str, str], int]:
    """Metadata and data size of a frame's JSON header; ValueError says what is wrong."""
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"bucket frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("bucket frame header must be a JSON object")
    meta, tensor = header.get("__metadata__"), header.get(FRAME_TENSOR)
    if not isinstance(meta, dict) or not isinstance(tensor, dict):
        raise ValueError(f"bucket frame needs '__metadata__' and one U8 tensor named '{FRAME_TENSOR}'")
    offsets = tensor.get("data_offsets")
    if tensor.get("dtype") != "U8" or not isinstance(offsets, list) or len(offsets) != 2 or offsets[0] != 0:
        raise ValueError(f"tensor '{FRAME_TENSOR}' must be U8 with data_offsets [0, nbytes]")
    nbytes = offsets[1]
    if not isinstance(nbytes, int) or nbytes < 0 or tensor.get("shape") != [nbytes]:
        raise ValueError("bucket frame: shape and data_offsets disagree")
    return {str(k): str(v) for k, v in meta.items()}, nbytes


def frame_chunks(buf: torch.Tensor, chunk: int = 2**20) -> Iterator[memoryview]:
    view = buf.numpy().data.cast("B")
    for start in range(0, len(view), chunk):
        yield view[start : start + chunk]


# ---- trainer side ------------------------------------------------------------------------------
@dataclass
class Endpoint:
    """One server taking part in an ``http`` session."""

    url: str
    #: Carries the server's API key: kept out of ``repr()`` (logs, tracebacks with locals).
    headers: dict[str, str] = field(repr=False)
    ranks: int = 1


_endpoints: dict[str, list[Endpoint]] = {}
#: Why an engine of a session cannot join (so the sender fails at once instead of timing out).
_refusals: dict[str, Exception] = {}
_endpoints_cv = threading.Condition()
#: How often a waiting sender looks at its ``cancelled`` event (``cancel`` does not notify).
_CHECK_S = 0.1


def register_endpoint(session_id: str, endpoint: Endpoint) -> None:
    """Called by a ``remote`` engine once its server accepted ``/weights/init`` for the weight sync ``session_id``."""
    with _endpoints_cv:
        _endpoints.setdefault(session_id, []).append(endpoint)
        _endpoints_cv.notify_all()


def refuse_session(session_id: str, error: Exception) -> None:
    """An engine of the weight sync ``session_id`` cannot join it (its server refused
    ``/weights/init`` or could not be reached): the session's sender raises ``error`` at once
    instead of waiting out its timeout for an endpoint that will never register."""
    with _endpoints_cv:
        _refusals.setdefault(session_id, error)
        _endpoints_cv.notify_all()


def unregister_endpoint(session_id: str, url: str) -> None:
    with _endpoints_cv:
        left = [e for e in _endpoints.get(session_id, []) if e.url != url]
        if left:
            _endpoints[session_id] = left
        else:
            _endpoints.pop(session_id, None)


class HttpSender(TransportSender):
    """Streams buckets to every server of the session (one POST per bucket and server).

    Options: ``connect_timeout_s`` (default 10), ``chunk_bytes`` (request body chunk, default 1 MiB: h11 copies each chunk once more).
    """

    name: ClassVar[str] = "http"
    reuses_buffers: ClassVar[bool] = True

    def __init__(self, *, session_id: str, world_size: int, timeout_s: float, options: dict[str, Any]):
        super().__init__(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options)
        self.endpoints: list[Endpoint] = []
        self._client: Any = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._inflight: list[tuple[int, Endpoint, cf.Future[Any]]] = []
        self._update = ""
        self._version = 0

    def connect(self) -> None:
        import httpx

        deadline = time.monotonic() + self.timeout_s
        with _endpoints_cv:
            while sum(e.ranks for e in _endpoints.get(self.session_id, [])) < self.world_size - 1:
                if self.session_id in _refusals:
                    raise _refusals.pop(self.session_id)
                self.raise_if_cancelled()  # an engine refused (connect_weight_sync cancels us)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncError(
                        "http: not every engine joined the session in time; only 'remote' engines can "
                        "receive over 'http'", peer="engine",
                    )
                _endpoints_cv.wait(min(left, _CHECK_S))
            self.endpoints = list(_endpoints[self.session_id])
        timeout = httpx.Timeout(self.timeout_s, connect=float(self.options.get("connect_timeout_s", 10.0)))
        self._client = httpx.Client(timeout=timeout, limits=httpx.Limits(
            max_connections=4 * len(self.endpoints), keepalive_expiry=KEEPALIVE_EXPIRY_S))
        self._pool = cf.ThreadPoolExecutor(max_workers=2 * len(self.endpoints), thread_name_prefix="roe-http-send")

    def begin(self, manifest: WeightManifest) -> None:
        self._update, self._version = manifest.session_id, manifest.version
        self._inflight = []

    def _post(self, endpoint: Endpoint, index: int, prefix: bytes, buf: torch.Tensor) -> None:
        chunk = int(self.options.get("chunk_bytes", 2**20))

        def body() -> Iterator[bytes | memoryview]:
            yield prefix
            yield from frame_chunks(buf, chunk)

        headers = dict(endpoint.headers)
        headers["content-type"] = "application/octet-stream"
        headers["content-length"] = str(len(prefix) + buf.numel())
        try:
            resp = self._client.post(f"{endpoint.url}/weights/bucket", content=body(), headers=headers)
        except Exception as exc:
            raise WeightSyncError(f"http: sending failed: {exc!r}", peer=endpoint.url, bucket=index) from exc
        if resp.status_code != 200:
            try:
                message = resp.json()["error"]["message"]
            except Exception:
                message = resp.text[:300]
            raise WeightSyncError(f"http: server refused the bucket (HTTP {resp.status_code}): {message}",
                                  peer=endpoint.url, bucket=index)

    def _wait(self, keep_last: bool) -> None:
        done_upto = len(self._inflight) - (len(self.endpoints) if keep_last else 0)
        pending, self._inflight = self._inflight[:done_upto], self._inflight[done_upto:]
        for index, endpoint, fut in pending:
            try:
                fut.result(timeout=self.timeout_s)
            except cf.TimeoutError:
                raise WeightSyncError(f"http: no answer within {self.timeout_s:.0f} s", peer=endpoint.url,
                                      bucket=index) from None

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        assert self._pool is not None, "connect() first"
        meta = {"session": self.session_id, "update": self._update, "version": str(self._version),
                "index": str(header.index), "checksum": str(header.checksum), "status": str(header.status)}
        prefix = frame_prefix(meta, header.nbytes)
        data = buf[: header.nbytes]
        # Wait for bucket i-1 before returning: the caller packs bucket i+1 into i-1's buffer next.
        self._wait(keep_last=False)
        for endpoint in self.endpoints:
            fut = self._pool.submit(self._post, endpoint, header.index, prefix, data)
            self._inflight.append((header.index, endpoint, fut))

    def end(self, manifest: WeightManifest) -> None:
        self._wait(keep_last=False)

    def abort(self, reason: str) -> None:
        for _, _, fut in self._inflight:
            fut.cancel()
        self._inflight = []
        if self._client is None:
            return
        for endpoint in self.endpoints:
            try:
                self._client.post(f"{endpoint.url}/weights/abort", headers=endpoint.headers, timeout=5.0,
                                  json={"session": self.session_id, "update": self._update, "reason": reason[:1000]})
            except Exception:  # the server may be the peer that failed; its receiver times out then
                logger.debug("abort to %s failed", endpoint.url, exc_info=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None
        with _endpoints_cv:
            _endpoints.pop(self.session_id, None)
            _refusals.pop(self.session_id, None)


#: Local session ids opened by a server's ingress; an ``http`` receiver outside them has no server.
_relay_sessions: set[str] = set()


class HttpReceiver(InprocReceiver):
    """Receiver half for an engine that runs inside a server process and declares ``http`` itself:
    the server hands it the POSTed buckets directly (no other transport in between)."""

    name: ClassVar[str] = "http"

    def connect(self) -> None:
        if self.spec.session_id not in _relay_sessions:
            reason = ("the 'http' transport carries weights to engines behind a rollout-engines server "
                      "(backend 'remote'); for an engine in this process use 'inproc' (or 'shm' across processes)")
            refuse_session(self.spec.session_id, CapabilityError(reason))  # the sender stops waiting for us
            raise CapabilityError(reason)
        super().connect()


class _RelaySender(InprocSender):
    """In-process relay into the served engine's receiver queues that never blocks past an
    abort: a full queue is retried in short waits while the update is still alive."""

    name: ClassVar[str] = "inproc"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cancelled = threading.Event()

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        deadline = time.monotonic() + self.timeout_s
        for rank, q in self._queues().items():
            while True:
                if self.cancelled.is_set():
                    return
                try:
                    q.put((self._token, header, buf), timeout=0.1)
                    break
                except queue.Full:
                    if time.monotonic() > deadline:
                        raise WeightSyncError("relay: the engine stopped reading buckets", peer=f"rank {rank}",
                                              bucket=header.index) from None

    def drain(self) -> None:
        for q in self._queues().values():
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break

    def abort(self, reason: str) -> None:
        # Drop what is queued so the receiver's next read is the abort itself.
        self.drain()
        super().abort(reason)


# ---- server side -------------------------------------------------------------------------------
@dataclass
class _Session:
    spec: TransportSpec
    local: str
    sender: TransportSender
    manifest: WeightManifest | None = None
    next_index: int = 0
    failed: BaseException | None = None
    done: bool = True
    feeding: int = 0
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)


def relay_transport(engine: Engine) -> str | None:
    """The local transport a server relays ``http`` buckets through for this engine, if any
    (in-process queues only where the engine's receivers live in the server's process)."""
    caps = engine.capabilities
    order = RELAY_PREFERENCE if not caps.multi_process else tuple(t for t in RELAY_PREFERENCE if t in ("shm", "disk"))
    for name in order:
        if name in caps.transports:
            return name
    return None


class HttpIngress:
    """The server's end of ``http`` sessions (one at a time, as one engine takes one update at a time)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.session: _Session | None = None

    async def open(self, spec: TransportSpec) -> None:
        from rollout_engines.plugins import get_registry

        await self.close()
        local = relay_transport(self.engine)
        if local is None:
            raise CapabilityError(
                f"this server's engine receives weights over {list(self.engine.capabilities.transports)}, "
                "none of which the server can relay 'http' buckets through; use one of those transports"
            )
        world = 1 + self.engine.weight_receivers()
        local_id = f"http-{spec.session_id}-{uuid.uuid4().hex[:8]}"
        _relay_sessions.add(local_id)
        if local in ("inproc", "http"):
            sender: TransportSender = _RelaySender(session_id=local_id, world_size=world, timeout_s=spec.timeout_s,
                                                   options={})
        else:
            cls = get_registry().transport(local).load_sender()
            sender = cls(session_id=local_id, world_size=world, timeout_s=spec.timeout_s, options={})
        local_spec = TransportSpec(transport=local, session_id=local_id, rank_offset=1, world_size=world,
                                   timeout_s=spec.timeout_s, options=sender.spec_options())
        connect = asyncio.ensure_future(asyncio.to_thread(sender.connect))
        join = asyncio.ensure_future(self.engine.init_weight_transfer(local_spec))
        try:
            await asyncio.wait({connect, join}, return_when=asyncio.FIRST_EXCEPTION)
            if join.done() and join.exception() is not None:
                sender.cancel(f"the served engine refused to join: {join.exception()}")  # the relay stops waiting
            await asyncio.wait({connect, join})
        except BaseException:  # /weights/init was cancelled (its client went away): neither goes on alone
            join.cancel()
            sender.cancel("the /weights/init request was cancelled")
            await asyncio.wait({connect, join})
            await self._undo_open(local_id, sender, join)
            raise
        # The engine's refusal says why; the relay's wait it cancelled does not.
        errors = [e for e in (join.exception(), connect.exception()) if e is not None]
        if errors:
            await self._undo_open(local_id, sender, join)
            raise errors[0]
        self.session = _Session(spec=spec, local=local, sender=sender)
        logger.info("http weight session %s relays through '%s'", spec.session_id, local)

    async def _undo_open(self, local_id: str, sender: TransportSender, join: asyncio.Future[None]) -> None:
        """A relay that did not open: the engine leaves its side if it joined, the relay closes."""
        _relay_sessions.discard(local_id)
        try:
            if not join.cancelled() and join.exception() is None:
                await self.engine.close_weight_transfer()
        finally:
            await asyncio.to_thread(sender.close)

    def _session(self, session_id: str | None = None) -> _Session:
        s = self.session
        if s is None or (session_id is not None and s.spec.session_id != session_id):
            raise WeightSyncError("no such 'http' weight session on this server; call /weights/init first")
        return s

    async def update(self, manifest: WeightManifest) -> int:
        s = self._session()
        async with s.cond:
            if not s.done:
                raise WeightSyncError("another update is in progress on this server; wait for it to finish")
            # Taken, but no bucket is fed before the relay began this update (the relay's queues
            # tag each bucket with its update: one fed first would go out as the last update's).
            s.manifest, s.done = None, False
        local_manifest = manifest.model_copy(update={"transport": s.local})
        try:
            try:
                await asyncio.to_thread(s.sender.begin, local_manifest)
            finally:
                async with s.cond:
                    s.manifest, s.next_index, s.failed = manifest, 0, None
                    s.cond.notify_all()
            version = await self.engine.receive_weights(local_manifest)
            await asyncio.to_thread(s.sender.end, local_manifest)
            return version
        except BaseException as exc:
            s.failed = exc
            if isinstance(s.sender, _RelaySender):
                s.sender.cancelled.set()
            raise
        finally:
            async with s.cond:
                s.done = True
                s.cond.notify_all()
                await s.cond.wait_for(lambda: s.feeding == 0)
            if isinstance(s.sender, _RelaySender):
                # Nothing of a failed update may wait in a queue for the next one.
                s.sender.drain()
                s.sender.cancelled.clear()

    async def push(self, manifest: WeightManifest, bucket: Callable[[int], torch.Tensor]) -> int:
        """Apply one update whose bytes are already in this process (``bucket(i)``: bucket ``i``
        laid out as ``manifest`` says) through the open session, as if a trainer had POSTed them:
        the server's own pushes (vLLM-style updates, LoRA adapters loaded from a path) take the
        same relay, checks and versioning as ``/weights/update``. Returns the applied version."""
        s = self._session()
        task = asyncio.ensure_future(self.update(manifest))
        try:
            # Feed only once the ingress runs this update (a bucket that came first would read the
            # outcome of the previous one).
            while not task.done() and (s.manifest is None or s.manifest.session_id != manifest.session_id):
                await asyncio.sleep(0.002)
            for b in manifest.buckets:
                if task.done():
                    break
                buf = bucket(b.index)
                meta = {"session": s.spec.session_id, "update": manifest.session_id, "index": str(b.index),
                        "checksum": str(checksum(buf, manifest.checksum))}
                await self.feed(meta, buf)
        except BaseException as exc:
            if not task.done():
                await self.abort(s.spec.session_id, manifest.session_id, f"relay failed: {exc}")
            await asyncio.wait({task}, timeout=s.spec.timeout_s)
            cause = task.exception() if task.done() and not task.cancelled() else None
            if cause is not None and isinstance(exc, WeightSyncError):
                raise cause from exc  # the engine's own error says why (a refused adapter, ...)
            raise
        return await task

    async def feed(self, meta: dict[str, str], buf: torch.Tensor) -> None:
        """Relay one POSTed bucket (waits for its turn: buckets go to the engine in order)."""
        session, update = meta.get("session"), meta.get("update")
        try:
            index, nbytes = int(meta["index"]), buf.numel()
            header = BucketHeader(index=index, nbytes=nbytes, checksum=int(meta.get("checksum", "0")),
                                  status=int(meta.get("status", "0")))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"bucket frame metadata incomplete: {exc}") from None
        s = self._session(session)

        def this_update_failed() -> bool:
            # A failure belongs to the update it ended: a bucket of the next update, posted before
            # that update started, waits for its turn instead of reading the old failure.
            m = s.manifest
            return s.failed is not None and m is not None and m.session_id == update

        def my_turn() -> bool:
            if this_update_failed():
                return True
            m = s.manifest
            return m is not None and m.session_id == update and not s.done and s.next_index == index

        async with s.cond:
            try:
                await asyncio.wait_for(s.cond.wait_for(my_turn), timeout=s.spec.timeout_s)
            except asyncio.TimeoutError:
                raise WeightSyncError(f"bucket {index} of update {update} waited {s.spec.timeout_s:.0f} s for "
                                      "its update to start or its turn", peer="trainer", bucket=index) from None
            if this_update_failed():
                raise WeightSyncError(f"the update this bucket belongs to failed: {s.failed}", bucket=index)
            s.feeding += 1
        try:
            await asyncio.to_thread(s.sender.send_bucket, header, buf)
        finally:
            async with s.cond:
                s.feeding -= 1
                s.next_index = index + 1
                s.cond.notify_all()

    async def abort(self, session_id: str, update: str, reason: str) -> None:
        s = self._session(session_id)
        if s.manifest is not None and s.manifest.session_id == update and not s.done:
            await asyncio.to_thread(s.sender.abort, reason or "aborted by the trainer")

    async def close(self) -> None:
        s, self.session = self.session, None
        if s is not None:
            try:
                await self.engine.close_weight_transfer()
            finally:
                _relay_sessions.discard(s.sender.session_id)
                await asyncio.to_thread(s.sender.close)
