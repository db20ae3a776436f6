"""``EngineGroup``: many engines (data-parallel replicas) behind one engine.

The members can be any :class:`~rollout_engines.engine.Engine`: local objects, Ray actors
(:class:`rollout_engines.ray.RayEngine`), remote servers. The group is an engine itself, so a
trainer's code does not change when it goes from one engine to many::

    group = EngineGroup([e0, e1, e2], routing="least_outstanding", max_outstanding_per_engine=64)
    outs = await group.generate(request)
    sync = await connect_weight_sync([group], "gloo")   # every worker of every member, one session
    await sync.push(model.state_dict().items(), version=step)

What the group does:

- **Routing** (``routing=``): ``round_robin``; ``least_outstanding`` (fewest requests in flight);
  ``sticky``: requests with the same ``request.session_id`` go to the same member (a multi-turn
  agent keeps its prefix cache); the mapping is a fixed hash of the session id, moved to the next
  member only while that member cannot serve. Requests without a session id use least-outstanding.
- **Backpressure**: at most ``max_outstanding_per_engine`` requests (batches) in flight per member;
  further requests wait for a slot, and raise :class:`EngineUnavailable` after ``wait_timeout_s``.
- **Capabilities**: the group declares what every current member can do (flags AND-ed, limits
  such as ``lora``, ``max_loras`` and ``top_logprobs`` the smallest, sets such as ``pause_modes``
  intersected), recomputed whenever a member is added, replaced or removed: a request beyond them
  is refused by the group with the usual :class:`CapabilityError` / ``UpdateRefused``, and they
  rise again when the weaker member leaves. An engine that lacks a flag the group declares cannot
  join (:meth:`add_engine`, :meth:`replace_engine`).
- **Fan-out** of sleep / wake_up / reset_prefix_cache / pause / resume / abort_all to every member;
  the group's ``pause_modes`` are those every member has.
- **Async RL**: the group records which member runs each request id when it routes a request, so
  ``abort(ids)`` goes to the member that owns each id (ids of finished requests are forgotten;
  unknown ids are ignored; an id still waiting in the group for a slot is aborted as soon as its
  request reaches a member). ``stream`` is routed like ``generate`` and stays on one member (a
  member that fails before the first delta is retried elsewhere; after it, the stream raises). A
  request with ``continue_from`` goes back to the member that produced the earlier completion (the
  group remembers the last ``remembered_completions`` request ids it answered) while that member
  serves, else it is routed like any other.
- **Weight sync**: :meth:`weight_receivers` is the sum over members; :meth:`init_weight_transfer`
  gives member *i* the rank offset ``spec.rank_offset + receivers of members 0..i-1``;
  :meth:`receive_weights` fans the manifest out to the members of the session.
- **LoRA adapters**: a LoRA push (``WeightSync.push_lora``) goes to every member of the session
  (the group's ``lora`` and ``max_loras`` are the smallest of its current members'), ``unload_lora`` to
  every member. The group records a member as holding an adapter's version only once that member
  applied it, and a request naming an adapter goes only to members that hold the group's version
  of it (the newest any member applied: ``loras``). A push that fails on some members raises
  :class:`WeightSyncError` naming them, as a full push does; the others serve the new version.
- **Failures**: a member that raises an engine failure (:class:`EngineUnavailable`,
  :class:`EngineClosed`, connection errors, a dead actor, or any other error while its health check
  also fails) is marked down; its in-flight and queued requests are retried on the other members.
  A request's result is always taken from exactly one member. Client errors (validation,
  :class:`CapabilityError`, an asleep engine, weight-sync errors) are raised to the caller, never
  retried. Health checks run every ``health_interval_s``.
- **Rejoin**: a member is only given traffic while its weight version equals the group's latest
  version. A member that comes back (healthy again, restarted by Ray, or added with
  :meth:`add_engine`) with an older version is first brought up to date, by one of (in order):

  1. ``on_rejoin(engine, version)``: an async callback of the caller's; it must leave ``engine`` at
     ``version`` (typically it pushes the trainer's current weights with
     ``connect_weight_sync([engine], ...)``);
  2. ``weight_source``: a directory, or a callable ``version -> named tensors``; the group pushes
     those tensors over ``rejoin_transport`` (default: the last weight sync's transport). The
     directory is either where the trainer pushes over the ``disk`` transport
     (``options={"path": dir}``: its newest complete update is used, and must be the group's
     version) or one holding ``*.safetensors`` files of the latest weights (HF names). The group
     never keeps weights in memory itself.

  Without either, a stale member stays out of traffic and an error is logged once.

Collective transports (``gloo``, ``nccl``) fix their members at connect time: after a member died,
the next push of that session fails with :class:`WeightSyncError` (it names the member). Close the
session and connect again (``connect_weight_sync([group], ...)``); the new session includes every
healthy member, and members that missed a push rejoin as described above.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from ..engine import EngineProtocol, abort_repeatedly
from ..errors import (
    CapabilityError,
    EngineUnavailable,
    ManifestMismatch,
    StaleVersion,
    WeightSyncError,
)
from ..types import Completion, EngineConfig, GenerateRequest, PauseMode, StreamDelta
from ..weights.manifest import TransportSpec, WeightManifest
from .membership import CLIENT_ERRORS, RejoinCallback, WeightSource, _Member, logger
from .router import ROUTINGS, Routing, _Router


class EngineGroup(_Router):
    """N engines of any backend behind the engine API (see the module docstring)."""

    backend_name = "group"
    reset_prefix_cache_on_wake = False  # members reset their own caches when they wake
    #: How many answered request ids the group remembers (id -> member), for ``continue_from``.
    remembered_completions = 65_536

    def __init__(
        self,
        engines: Sequence[EngineProtocol],
        *,
        routing: Routing = "least_outstanding",
        max_outstanding_per_engine: int | None = 128,
        wait_timeout_s: float | None = 120.0,
        max_attempts: int = 3,
        health_interval_s: float | None = 5.0,
        health_timeout_s: float = 10.0,
        on_rejoin: RejoinCallback | None = None,
        weight_source: WeightSource | None = None,
        rejoin_transport: str | None = None,
    ) -> None:
        """
        Args:
            engines: the members (at least one; each object once).
            routing: ``round_robin``, ``least_outstanding`` or ``sticky`` (by ``request.session_id``).
            max_outstanding_per_engine: requests in flight per member before new ones wait
                (None: unbounded).
            wait_timeout_s: how long a request waits for a free slot or for a member to come back
                before :class:`EngineUnavailable` (None: wait indefinitely).
            max_attempts: members a request is tried on before its last engine failure is raised.
            health_interval_s: seconds between background health checks (None: only on demand,
                via :meth:`check_health`).
            health_timeout_s: a health check slower than this counts as a failure.
            on_rejoin: ``async (engine, version) -> None`` that brings a returning member to
                ``version``.
            weight_source: directory of safetensors (or callable ``version -> tensors``) the group
                pushes to a returning member when ``on_rejoin`` is not given.
            rejoin_transport: transport for that push (default: the last weight sync's).
        """
        engines = list(engines)
        if not engines:
            raise ValueError("EngineGroup needs at least one engine")
        if len({id(e) for e in engines}) != len(engines):
            raise ValueError("EngineGroup got the same engine object twice; pass each engine once")
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing '{routing}'; choose one of: {', '.join(ROUTINGS)}")
        if max_outstanding_per_engine is not None and max_outstanding_per_engine < 1:
            raise ValueError("max_outstanding_per_engine must be >= 1 (or None for unbounded)")
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        first = engines[0].config
        super().__init__(EngineConfig(backend="group", model=first.model, tokenizer=first.tokenizer))
        self.routing: Routing = routing
        self.max_outstanding = max_outstanding_per_engine
        self.wait_timeout_s = wait_timeout_s
        self.max_attempts = max_attempts
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.on_rejoin = on_rejoin
        self.weight_source = weight_source
        self.rejoin_transport = rejoin_transport
        self._members = [_Member(e, i) for i, e in enumerate(engines)]
        self._recompute_capabilities()
        self.weight_version = max(m.version for m in self._members)
        for m in self._members:  # adapters the members hold already: the newest version of each
            for name, version in m.loras.items():
                self.loras[name] = max(version, self.loras.get(name, version))
        for m in self._members:
            m.serving = m.version == self.weight_version
        self._rr = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        # tasks the group cancelled because their member went down (they retry, not fail)
        self._evicted: set[asyncio.Task[Any]] = set()
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._weights_lock: asyncio.Lock | None = None
        self._state_lock = asyncio.Lock()
        self._session_plan: list[_Member] | None = None
        self._last_transport: str | None = None
        self._sleep_state: tuple[int, list[str]] | None = None
        self.retried = 0
        # request id -> the member running it (None: waiting in the group for a slot)
        self._owners: dict[str, _Member | None] = {}
        self._abort_on_arrival: set[str] = set()  # aborted while waiting in the group
        # request id of an answered completion -> index of the member that produced it
        self._produced: OrderedDict[str, int] = OrderedDict()

    def _admit(self, request: GenerateRequest) -> tuple[Sequence[str], Any]:
        """What :meth:`_generate` and :meth:`_stream` do before routing: start the health loop,
        check the adapter, record the request's ids (the caller releases them with ``_leave``).
        Returns the ids and the member a continuation prefers (its producer), if any."""
        if self._health_task is None and self.health_interval_s is not None:
            self._ensure_started()
        ids = request.request_ids or ()
        prefer = self._producer(request) if request.continue_from is not None else None
        self._check_lora(request)
        self._enter(ids)
        return ids, prefer

    async def _generate(self, request: GenerateRequest) -> list[Completion]:
        deadline = None
        failures = 0
        task = asyncio.current_task()
        assert task is not None
        ids, prefer = self._admit(request)
        try:
            while True:
                member, queue = self._pick(request, prefer)
                if member is None or queue:  # no slot, or requests queued ahead of this one
                    if deadline is None and self.wait_timeout_s is not None:
                        deadline = asyncio.get_running_loop().time() + self.wait_timeout_s
                    member = await self._wait(request, deadline, prefer)
                killer = self._route(ids, member)
                member.outstanding += 1
                member.inflight.add(task)
                try:
                    result = await member.engine.generate(request)
                except asyncio.CancelledError:
                    if not (self._evicted and self._take_eviction(task)):
                        raise  # the caller cancelled
                    error: BaseException = EngineUnavailable(f"member {member.index} was marked down")
                except CLIENT_ERRORS:
                    if self._evicted:
                        self._take_eviction(task)
                    raise
                except Exception as exc:
                    if self._evicted:
                        self._take_eviction(task)
                    error = exc
                else:
                    if self._evicted:  # the engine answered although the group cancelled it
                        self._take_eviction(task)
                    member.completed += 1
                    for c in result:
                        self._remember(c.request_id, member)
                    return result
                finally:
                    if killer is not None:
                        killer.cancel()
                    member.inflight.discard(task)
                    member.outstanding -= 1
                    self._release(member)
                # The member's attempt has ended: from here the ids wait in the group again, so an
                # abort while the group decides (a health check) reaches the retry (_route).
                self._enter(ids)
                if not await self._is_engine_failure(member, error):
                    raise error
                failures += 1
                if failures >= self.max_attempts:
                    raise EngineUnavailable(
                        f"request failed on {failures} engines of the group; last error: {error!r}"
                    ) from error
                self.retried += 1
                logger.debug("retrying a request after member %d failed: %r", member.index, error)
                self._ensure_started()
        finally:
            self._leave(ids)

    async def _stream(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        """Routed like :meth:`_generate`; the whole stream stays on one member. A member that fails
        (or is marked down while the stream waits for its next delta) before its first delta is
        retried elsewhere; one that fails after it ends the stream with the error (the deltas
        already delivered cannot be taken back)."""
        deadline = None
        failures = 0
        ids, prefer = self._admit(request)
        try:
            while True:
                member, queue = self._pick(request, prefer)
                if member is None or queue:
                    if deadline is None and self.wait_timeout_s is not None:
                        deadline = asyncio.get_running_loop().time() + self.wait_timeout_s
                    member = await self._wait(request, deadline, prefer)
                killer = self._route(ids, member)
                member.outstanding += 1
                delivered = False
                deltas = member.engine.stream(request)
                try:
                    while True:
                        try:
                            delta = await self._next_delta(member, deltas)
                        except StopAsyncIteration:
                            break
                        delivered = True
                        if delta.finish_reason is not None:  # this sequence is done: not abortable
                            self._owners.pop(delta.request_id, None)
                            self._remember(delta.request_id, member)
                        yield delta
                except CLIENT_ERRORS:
                    raise
                except Exception as exc:
                    error: BaseException = exc
                    # The ids wait in the group again (while the member's stream closes and the
                    # group decides): an abort meanwhile reaches a retry (_route).
                    self._enter(ids)
                else:
                    member.completed += 1
                    return
                finally:
                    if killer is not None:
                        killer.cancel()
                    member.outstanding -= 1
                    self._release(member)
                    close = getattr(deltas, "aclose", None)  # the member's stream ends with ours
                    if close is not None:
                        await close()
                if not await self._is_engine_failure(member, error):
                    raise error
                if delivered:
                    raise EngineUnavailable(
                        f"member {member.index} failed in the middle of a stream: {error!r}"
                    ) from error
                failures += 1
                if failures >= self.max_attempts:
                    raise EngineUnavailable(
                        f"stream failed on {failures} engines of the group; last error: {error!r}"
                    ) from error
                self.retried += 1
                self._ensure_started()
        finally:
            self._leave(ids)

    async def _next_delta(self, member: _Member, deltas: AsyncGenerator[StreamDelta, None]) -> StreamDelta:
        """The member's next delta. While it is awaited the task counts as in flight on the member,
        so a member marked down meanwhile ends the wait (:class:`EngineUnavailable`), as it does a
        :meth:`_generate`; while the caller holds a delta, it does not."""
        task = asyncio.current_task()
        assert task is not None
        member.inflight.add(task)
        try:
            delta = await deltas.__anext__()
        except asyncio.CancelledError:
            if not (self._evicted and self._take_eviction(task)):
                raise  # the caller cancelled
            raise EngineUnavailable(f"member {member.index} was marked down") from None
        except BaseException:
            if self._evicted:
                self._take_eviction(task)
            raise
        finally:
            member.inflight.discard(task)
        if self._evicted:  # the member answered although the group cancelled the wait
            self._take_eviction(task)
        return delta

    # ---- request ids: abort routing and continuation ---------------------------------------------
    def _enter(self, ids: Sequence[str]) -> None:
        """These ids wait in the group (for a slot or a member)."""
        owners = self._owners
        for rid in ids:
            owners[rid] = None

    def _route(self, ids: Sequence[str], member: _Member) -> asyncio.Task[None] | None:
        """These ids run on ``member`` now. Ids aborted while they waited are aborted there as soon
        as the member knows them: returns the task that does it (cancel it once the request ended)."""
        owners = self._owners
        for rid in ids:
            owners[rid] = member
        if not self._abort_on_arrival:
            return None
        doomed = [rid for rid in ids if rid in self._abort_on_arrival]
        if not doomed:
            return None
        self._abort_on_arrival.difference_update(doomed)
        return asyncio.get_running_loop().create_task(self._abort_on(member, doomed))

    async def _abort_on(self, member: _Member, ids: list[str]) -> None:
        # Repeated until the request ended (the caller cancels this): see abort_repeatedly.
        await abort_repeatedly(member.engine.abort, ids, f"engine group member {member.index}")

    def _leave(self, ids: Sequence[str]) -> None:
        owners, doomed = self._owners, self._abort_on_arrival
        for rid in ids:
            owners.pop(rid, None)
            doomed.discard(rid)

    def _remember(self, request_id: str, member: _Member) -> None:
        if not request_id:
            return
        produced = self._produced
        produced[request_id] = member.index
        produced.move_to_end(request_id)
        while len(produced) > self.remembered_completions:
            produced.popitem(last=False)

    def _producer(self, request: GenerateRequest) -> _Member | None:
        """The serving member that produced one of the completions ``request`` continues."""
        for prior in request.continue_from or ():
            index = self._produced.get(prior.request_id)
            if index is not None and index < len(self._members) and self._members[index].serving:
                return self._members[index]
        return None

    async def _abort(self, request_ids: Sequence[str] | None) -> None:
        owners = self._owners
        if request_ids is None:
            self._abort_on_arrival.update(rid for rid, m in owners.items() if m is None)
            await self._fan_out(lambda e: e.abort_all(), "abort_all")
            return
        mine: dict[int, list[str]] = {}
        targets: list[_Member] = []
        for rid in request_ids:
            if rid not in owners:
                continue  # unknown or finished
            m = owners[rid]
            if m is None:
                self._abort_on_arrival.add(rid)
                continue
            if id(m.engine) not in mine:
                targets.append(m)
            mine.setdefault(id(m.engine), []).append(rid)
        if targets:
            await self._fan_out(lambda e: e.abort(mine[id(e)]), "abort", members=targets)

    def _take_eviction(self, task: asyncio.Task[Any]) -> bool:
        """Withdraw the group's cancellation of ``task`` (its member went down); False if the
        group had not cancelled it, or if the caller cancelled it as well (then the cancellation is
        the caller's: the request ends, it is not retried; Python 3.10 does not count cancellations,
        so there such a request is retried). The engine may have turned the cancellation into
        another error."""
        if task not in self._evicted:
            return False
        self._evicted.discard(task)
        uncancel = getattr(task, "uncancel", None)  # Python >= 3.11 counts cancellations
        if uncancel is not None:
            return bool(uncancel() == 0)
        return True

    # ---- fan-out -------------------------------------------------------------------------------
    async def _fan_out(
        self, call: Callable[[EngineProtocol], Awaitable[Any]], what: str, members: Sequence[_Member] | None = None
    ) -> list[Any]:
        """Call every (healthy) member; client errors are raised, engine failures mark it down."""
        self._ensure_started()
        targets = [m for m in (members if members is not None else self._members) if m.healthy]
        results = await asyncio.gather(*(call(m.engine) for m in targets), return_exceptions=True)
        client: list[tuple[_Member, BaseException]] = []
        for m, r in zip(targets, results, strict=True):
            if isinstance(r, CLIENT_ERRORS):
                client.append((m, r))
            elif isinstance(r, BaseException):
                self._mark_down(m, r)
        if client:
            m, first = client[0]
            logger.warning("engine group: %s failed on %d/%d engines; member %d: %s", what, len(client),
                           len(targets), m.index, first)
            raise first
        return [r for r in results if not isinstance(r, BaseException)]

    # The state lock keeps a rejoining member's catch-up (membership._apply_group_state) from
    # interleaving with these fan-outs.
    async def _sleep(self, level: int, tags: Sequence[str]) -> None:
        async with self._state_lock:
            await self._fan_out(lambda e: e.sleep(level, tags), "sleep")
            self._sleep_state = (level, list(tags))

    async def _wake_up(self, tags: Sequence[str]) -> None:
        async with self._state_lock:
            await self._fan_out(lambda e: e.wake_up(tags), "wake_up")
            if self._sleep_state is not None:
                left = [t for t in self._sleep_state[1] if t not in tags]
                self._sleep_state = (self._sleep_state[0], left) if left else None

    async def _reset_prefix_cache(self) -> None:
        await self._fan_out(lambda e: e.reset_prefix_cache(), "reset_prefix_cache")

    async def _pause(self, mode: PauseMode) -> None:
        async with self._state_lock:
            await self._fan_out(lambda e: e.pause(mode), "pause")

    async def _resume(self) -> None:
        async with self._state_lock:
            await self._fan_out(lambda e: e.resume(), "resume")

    # ---- weight sync ---------------------------------------------------------------------------
    def weight_receivers(self) -> int:
        """Ranks of every healthy member's workers (what :func:`connect_weight_sync` reserves)."""
        plan = [m for m in self._members if m.healthy]
        self._session_plan = plan
        return sum(m.receivers for m in plan)

    async def _init_weight_transfer(self, spec: TransportSpec) -> None:
        self._ensure_started()
        plan = self._session_plan if self._session_plan is not None else [m for m in self._members if m.healthy]
        self._session_plan = None
        if not plan:
            raise EngineUnavailable("no engine of the group is healthy; nothing can join the weight sync")
        offsets, offset = [], spec.rank_offset
        for m in plan:
            offsets.append(offset)
            offset += m.receivers
        results = await asyncio.gather(
            *(m.engine.init_weight_transfer(spec.model_copy(update={"rank_offset": off})) for m, off in zip(plan, offsets, strict=True)),
            return_exceptions=True,
        )
        self._last_transport = spec.transport
        errors = []
        for m, r in zip(plan, results, strict=True):
            m.in_session = not isinstance(r, BaseException)
            if isinstance(r, BaseException):
                errors.append((m, r))
        if errors:
            m, first = errors[0]
            if isinstance(first, CapabilityError):
                raise first
            raise WeightSyncError(
                f"member {m.index} ({m.engine.backend_name}) could not join the '{spec.transport}' weight sync: {first}",
                peer=f"group member {m.index}",
            ) from first

    async def receive_weights(self, manifest: WeightManifest) -> int:
        """Fan one update out to every member of the session; returns the new version.

        Members that applied it serve at the new version; members that failed (or were not in the
        session) get no traffic until they are brought up to date (see *Rejoin*)."""
        self._check_not_closed()
        if manifest.lora is not None:
            return await self._receive_lora_checked(manifest)
        self._ensure_started()
        assert self._weights_lock is not None
        members = self._session_members()
        async with self._weights_lock:
            results = await asyncio.gather(*(m.engine.receive_weights(manifest) for m in members), return_exceptions=True)
            ok = [m for m, r in zip(members, results, strict=True) if not isinstance(r, BaseException)]
            failed = [(m, r) for m, r in zip(members, results, strict=True) if isinstance(r, BaseException)]
            for m in ok:
                m.version = manifest.version
            if ok and manifest.version != self.weight_version:
                self.weight_version = manifest.version
                for m in self._members:
                    if m.version != self.weight_version and m.serving:
                        m.serving = False  # stale: no traffic until it rejoins at this version
                        m.last_error = f"missed weight update v{manifest.version}"
            for m, r in failed:
                if not isinstance(r, CLIENT_ERRORS):
                    self._mark_down(m, r)
                m.in_session = False
        if failed:
            m, first = failed[0]
            detail = " | ".join(f"member {m.index} ({m.engine.backend_name}): {r}" for m, r in failed)
            raise WeightSyncError(
                f"weight update v{manifest.version} failed on {len(failed)}/{len(members)} engines of the group "
                f"({len(ok)} applied it): {detail}. Close this weight sync and connect again "
                "(connect_weight_sync([group], ...)); members that missed it rejoin once up to date",
                peer=f"group member {m.index}",
            ) from first
        if any(not m.serving for m in self._members):  # bring the members that missed it up to date
            task = asyncio.get_running_loop().create_task(self.check_health())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return self.weight_version

    def _session_members(self) -> list[_Member]:
        members = [m for m in self._members if m.in_session]
        if not members:
            raise WeightSyncError(
                "no engine of the group is in a weight-sync session; connect one with connect_weight_sync([group], ...)"
            )
        return members

    async def _receive_lora(self, manifest: WeightManifest) -> None:
        """A LoRA push to every member of the session. A member is recorded as holding this version
        only once it applied it; requests naming the adapter then go only to those members (one
        still holding an older version gets none of them). If some failed, the group serves the new
        version from the others and this raises :class:`WeightSyncError` naming the failed members
        (as a full push does); if all failed, nothing changed and one shared cause keeps its type
        (:class:`ManifestMismatch`, :class:`StaleVersion`: nothing was installed)."""
        self._ensure_started()
        assert self._weights_lock is not None and manifest.lora is not None
        name, version = manifest.lora.name, manifest.version
        members = self._session_members()
        async with self._weights_lock:
            results = await asyncio.gather(*(m.engine.receive_weights(manifest) for m in members), return_exceptions=True)
            ok = [m for m, r in zip(members, results, strict=True) if not isinstance(r, BaseException)]
            for m in ok:
                m.loras[name] = version
            if ok:
                self.loras[name] = version
        failed = [(m, r) for m, r in zip(members, results, strict=True) if isinstance(r, BaseException)]
        for m, r in failed:
            if not isinstance(r, CLIENT_ERRORS):
                self._mark_down(m, r)
                m.in_session = False
        if failed:
            m, first = failed[0]
            kind: type[WeightSyncError] = WeightSyncError
            if not ok and isinstance(first, StaleVersion | ManifestMismatch) and all(type(r) is type(first) for _, r in failed):
                kind = type(first)
            which = ", ".join(str(m.index) for m, _ in failed)
            outcome = (f"members {', '.join(str(m.index) for m in ok)} applied it and serve requests naming it; push a "
                       "higher version to bring the others along" if ok else "nothing was installed")
            detail = " | ".join(f"member {m.index} ({m.engine.backend_name}): {r}" for m, r in failed)
            raise kind(
                f"LoRA '{name}' v{version} failed on {len(failed)}/{len(members)} engines of the group (members "
                f"{which}); {outcome}: {detail}", peer=f"group members {which}",
            ) from first

    async def _unload_lora(self, name: str) -> None:
        await self._fan_out(lambda e: e.unload_lora(name), "unload_lora")

    async def unload_lora(self, name: str) -> bool:
        """Unload adapter ``name`` from every member (also members that hold another version of it
        after a LoRA push that failed on some); True if any held it."""
        self._check_not_closed()
        if name not in self.loras and not any(name in m.loras or name in getattr(m.engine, "loras", {})
                                              for m in self._members):
            return False
        await self._unload_lora(name)
        self.loras.pop(name, None)
        for m in self._members:
            m.loras.pop(name, None)
        return True

    async def close_weight_transfer(self) -> None:
        members = [m for m in self._members if m.in_session]
        for m in members:
            m.in_session = False
        await asyncio.gather(*(m.engine.close_weight_transfer() for m in members), return_exceptions=True)

    # ---- info / health / close -----------------------------------------------------------------
    def _outstanding_count(self) -> int:
        return sum(m.outstanding for m in self._members)

    def _can_serve(self) -> bool:
        return not self._closed and any(m.serving for m in self._members)

    def _extra_info(self) -> dict[str, Any]:
        return {"routing": self.routing, "retried": self.retried, "members": self.member_stats()}

    async def health(self) -> bool:
        """True while at least one member serves."""
        return self._can_serve()

    async def _stop(self) -> None:
        tasks = [t for t in (self._health_task, *self._background) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._health_task = None
        self._background.clear()
        self._wake_all()

    async def detach(self) -> list[EngineProtocol]:
        """Stop using the members without closing them (health checks stop; the group is closed
        afterwards); returns them, e.g. to build another group over the same engines."""
        self._closed = True
        await self._stop()
        return self.engines

    async def _close(self) -> None:
        await self._stop()
        results = await asyncio.gather(*(m.engine.close() for m in self._members), return_exceptions=True)
        for m, r in zip(self._members, results, strict=True):
            if isinstance(r, BaseException):
                logger.warning("engine group: closing member %d failed: %r", m.index, r)


__all__ = ["EngineGroup"]
