"""A doorbell: weight updates handed to an engine's workers through the weight-sync store.

An engine whose workers live in other processes starts each receive with its own RPC. For vLLM
that is ``collective_rpc``: a message to the engine core's input thread, its busy loop, the
executor, and the answer back through the output thread and the client's event loop; process
and thread hops on every push, however small. While the engine runs no request, nothing else
happens in its workers, and the host can ring them directly instead, through the store they
already joined for the transport (``shm``, ``cuda_ipc``, ``gloo``, ``nccl``; see
:mod:`.transports._store`):

- at set-up each worker starts a :class:`DoorbellListener`: a thread on a store connection of
  its own, blocked in the store's ``get`` of its next key, ``door/<door>/<n>/<rank>`` (the store
  answers it the moment the key is set: no polling while idle);
- the host (:class:`Doorbell`) sets those keys to the update's header (``manifest_to_wire``'s
  form without its tensor layout, which is stored once under ``door/<door>/layout/<m>`` while it
  does not change); each worker runs the receive it would have run for the RPC and sets
  ``door/<door>/<n>/done/<rank>`` to its result, then deletes its own keys of the ring before;
- the host's one thread waits for every worker's answer in a blocked ``multi_get``, checking the
  engine's health every :data:`ANSWER_WAIT_S` and giving up at the update's timeout (a push that
  outlasts the first blocked wait is then polled for: each blocked wait that times out makes the
  TCPStore client log two warnings).

Every value carries the session's signature (:class:`~.transports._store.SignedStore`): only
the trainer and its engines hold the secret, so nothing else can ring a worker or answer for
one (a ring without it is logged and never run, an answer without it is not taken for one). The
backend keeps the rule that makes this safe: it rings only while no request runs in the engine,
and lets none start until :attr:`Doorbell.busy` clears, which happens only once every worker
answered. Workers take each receive under one lock, so a receive by RPC never overlaps one by
the doorbell.

The vLLM plugin rings its workers, the SGLang plugin its scheduler process (which joined the
session as the rank of the engine's relay), once per update (:meth:`Doorbell.ring`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from ..errors import WeightSyncError
from .manifest import TransportSpec
from .transports import _store

logger = logging.getLogger("rollout_engines.weights")

#: How long a listener's wait lasts before it waits again (the store logs a line when a wait
#: times out: once an hour of idleness, not twice a second).
LISTEN_S = 3600.0
#: How long the host waits for the workers' answers at a time, between checks of the engine's
#: health (a push on one machine takes milliseconds; a longer one logs the store's warning for
#: the first wait's timeout, and is polled for from then on).
ANSWER_WAIT_S = 2.0
#: The longest nap between looks at the answers once a push outlasted the first blocked wait.
ANSWER_POLL_S = 0.005
_STOP = "stop"


def has_store(spec: TransportSpec) -> bool:
    """Whether ``spec``'s transport signals through a store a doorbell can use."""
    o = spec.options
    return isinstance(o.get("secret"), str) and "host" in o and "port" in o


def _join(spec: TransportSpec, timeout_s: float) -> _store.SignedStore:
    store = _store.join_store(spec.options, timeout_s)
    return _store.session_store(store, spec.session_id, _store.session_secret(spec.options))


def new_door() -> str:
    """A name for one engine's doorbell: its host and its workers' listeners use it in their keys."""
    return secrets.token_hex(8)


class Doorbell:
    """The host's side: rings the listeners named ``door`` of the workers of ranks ``ranks``."""

    def __init__(self, spec: TransportSpec, door: str, ranks: Sequence[int]) -> None:
        self.door, self.ranks = door, list(ranks)
        self.rings = 0
        self._kv = _join(spec, spec.timeout_s)
        # A blocked multi_get returns as soon as the last answer is stored; past this it raises
        # (and the store logs a line), the engine's health is checked, and the wait goes on.
        self._kv.raw.set_timeout(datetime.timedelta(seconds=ANSWER_WAIT_S))
        self._n = 0
        self._layout: tuple[str, int] | None = None  # the layout last stored, and its number
        self._layouts = 0
        self._busy = threading.Event()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="roe-doorbell")
        self.broken: str | None = None

    @property
    def busy(self) -> bool:
        """A ring is in progress (the engine must not run requests)."""
        return self._busy.is_set()

    def claim(self) -> bool:
        """Mark a ring as starting; False if one is in progress or the doorbell is broken. The
        caller checks that the engine is idle in the same critical section (or after claiming:
        then :meth:`release` if it is not)."""
        if self.broken is not None or self._busy.is_set():
            return False
        self._busy.set()
        return True

    def release(self) -> None:
        """End a claim that no ring follows (e.g. the engine turned out to be busy after all)."""
        self._busy.clear()

    async def ring(
        self, wire: Mapping[str, Any], *, timeout_s: float, check: Callable[[], None],
        then: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Hand ``wire`` (``manifest_to_wire``'s form) to every worker and wait until each answered;
        returns their result dicts in ``ranks`` order. Call after :meth:`claim`: the doorbell stays
        busy until every worker answered (also if the caller is cancelled meanwhile), and
        ``then(results)`` runs just before it is released. ``check()`` runs every
        :data:`ANSWER_WAIT_S` and raises if the engine failed. Workers that do not answer within
        ``timeout_s`` break the doorbell (the engine goes back to its RPC)."""
        try:  # the keys are set here, on the caller's loop (a set waits for no answer), so the
            # workers start at once, not after a thread hop; only the wait runs on the thread
            header, stale = self._post(wire)
        except BaseException:
            self._busy.clear()
            raise

        def run() -> list[dict[str, Any]]:
            try:
                results = self._answers(header, stale, timeout_s, check)
                if then is not None:
                    then(results)
                return results
            finally:
                self._busy.clear()

        return await asyncio.wrap_future(self._thread.submit(run))

    def _post(self, wire: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        """Store the ring's keys; returns its header and the layout key it replaced."""
        header = {k: v for k, v in wire.items() if k != "layout"}
        layout = wire["layout"]
        kv, door, stale = self._kv, self.door, None
        if self._layout is None or self._layout[0] is not layout:
            self._layouts += 1
            kv.set(f"door/{door}/layout/{self._layouts}", layout)
            if self._layout is not None:  # every worker answered the ring that read it
                stale = f"door/{door}/layout/{self._layout[1]}"
            self._layout = (layout, self._layouts)
        header["layout"] = self._layout[1]
        self._n += 1
        header["ring"] = self._n
        text = json.dumps(header)
        for r in self.ranks:  # one key per worker: each deletes its own once it answered
            kv.set(f"door/{door}/{self._n}/{r}", text)
        return header, stale

    def _answers(
        self, header: dict[str, Any], stale: str | None, timeout_s: float, check: Callable[[], None],
    ) -> list[dict[str, Any]]:
        kv, deadline = self._kv, time.monotonic() + timeout_s
        done = [f"door/{self.door}/{header['ring']}/done/{r}" for r in self.ranks]
        forged, checked = 0, time.monotonic()
        # Blocked in the store first (woken the moment the last answer is stored). A blocked wait
        # that times out makes the store's client log two warnings, so a push that outlasts one
        # (a long gloo or nccl update) is polled for from then on, which logs nothing.
        blocking, nap = True, 1e-4
        try:
            if stale is not None:
                kv.delete_key(stale)
            while True:
                try:
                    if blocking or kv.check(done):
                        answers = kv.multi_get(done)
                        break
                    time.sleep(nap)
                    nap = min(2 * nap, ANSWER_POLL_S)
                    if time.monotonic() - checked < ANSWER_WAIT_S:
                        continue
                except dist.DistStoreError:  # not all answered within the blocked wait
                    blocking = False
                except WeightSyncError as exc:
                    # Not signed with the session's secret: not an answer. The worker's own answer
                    # replaces it (the workers still receive: the engine stays busy meanwhile).
                    if not forged:
                        logger.warning("weight doorbell, update v%s: %s", header["version"], exc)
                    forged += 1
                    time.sleep(min(0.5, 0.001 * forged))
                    if time.monotonic() - checked < ANSWER_WAIT_S and time.monotonic() <= deadline:
                        continue
                check()
                checked = time.monotonic()
                if checked > deadline:
                    self.broken = f"a worker did not answer update v{header['version']} within {timeout_s:.0f} s"
                    raise WeightSyncError(
                        f"weight update v{header['version']}: {self.broken}", peer="engine workers"
                    ) from None
        except (RuntimeError, OSError) as exc:  # the store (the trainer's) is gone
            if isinstance(exc, WeightSyncError):
                raise
            raise WeightSyncError(f"lost the weight-sync store while the workers received ({exc})",
                                  peer="trainer (rank 0)") from exc
        self.rings += 1
        return [json.loads(v) for v in answers]

    def close(self) -> None:
        self._thread.shutdown(wait=False)
        if self._layout is not None:
            try:
                self._kv.delete_key(f"door/{self.door}/layout/{self._layout[1]}")
            except Exception:  # the trainer (the store's host) may be gone already
                pass


class DoorbellListener:
    """A worker's side: a thread that runs ``receive(wire)`` for each ring of the doorbell ``door``
    and answers with its result (a JSON-able dict). ``setup()`` runs first on that thread (e.g.
    select the CUDA device); ``lock`` is held around each receive (the worker's RPC receive takes
    it too)."""

    def __init__(
        self, spec: TransportSpec, door: str, *, rank: int, receive: Callable[[dict[str, Any]], dict[str, Any]],
        lock: threading.Lock, setup: Callable[[], None] | None = None,
    ) -> None:
        self.door = door
        self.rank, self._receive, self._lock, self._setup = rank, receive, lock, setup
        self._kv = _join(spec, spec.timeout_s)  # reads and answers
        # Blocked in get until rung (a connection serves one call at a time).
        self._waiter = _join(spec, spec.timeout_s)
        self._waiter.raw.set_timeout(datetime.timedelta(seconds=LISTEN_S))
        self._n = 0  # the last ring taken
        self._n_lock = threading.Lock()
        self._layouts: dict[int, str] = {}
        self._stopping = False
        self.rings = 0
        self._thread = threading.Thread(target=self._run, name=f"roe-doorbell-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
            forged = 0
            while not self._stopping:
                key = f"door/{self.door}/{self._n + 1}/{self.rank}"
                try:
                    raw = self._waiter.get(key).decode()  # returns as soon as the host rings
                except dist.DistStoreError:
                    continue  # an hour without an update: wait again
                except WeightSyncError as exc:  # not signed with the session's secret: never run
                    if not forged:
                        logger.warning("weight doorbell of rank %d: %s", self.rank, exc)
                    forged += 1
                    time.sleep(min(0.5, 0.001 * forged))  # until the host's own ring replaces it
                    continue
                with self._n_lock:
                    if self._stopping or raw == _STOP:
                        return
                    self._n += 1
                result = self._answer(raw)
                self._kv.set(f"door/{self.door}/{self._n}/done/{self.rank}", json.dumps(result, default=str))
                self.rings += 1
                # Tidy up after answering (the host read the last answer before it rang again).
                self._kv.delete_key(key)
                if self._n > 1:
                    self._kv.delete_key(f"door/{self.door}/{self._n - 1}/done/{self.rank}")
        except Exception as exc:  # the store is the trainer's: it is gone, or closing with us
            if not self._stopping:
                logger.info("weight doorbell of rank %d stopped: %s", self.rank, exc)

    def _answer(self, raw: str) -> dict[str, Any]:
        try:
            header = json.loads(raw)
            m = int(header["layout"])
            layout = self._layouts.get(m)
            if layout is None:
                layout = self._kv.get(f"door/{self.door}/layout/{m}").decode()
                self._layouts = {m: layout}
            with self._lock:
                return self._receive({**header, "layout": layout})
        except Exception as exc:  # the receive answers its own errors; this is the ring's
            from ..proxy import WireError

            return {"ok": False, **WireError.of(exc).model_dump()}

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (a receive in progress finishes first, within the transport's bounds)."""
        with self._n_lock:
            if self._stopping:
                return
            self._stopping = True
            key = f"door/{self.door}/{self._n + 1}/{self.rank}"  # what the thread waits for, or will next
        try:
            self._kv.set(key, _STOP)
        except Exception:
            pass  # the store is gone: the thread's wait fails and it ends
        self._thread.join(timeout_s)
