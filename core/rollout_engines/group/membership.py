"""Membership of an :class:`~rollout_engines.group.EngineGroup`: what the group knows about each
member (:class:`_Member`), which errors mark a member down, health checks, and bringing a returning
member back to the group's weight version (*Rejoin* in :mod:`rollout_engines.group.engine`)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine import Capabilities, Engine, EngineProtocol
from ..errors import (
    CapabilityError,
    EngineAsleep,
    EngineClosed,
    EngineUnavailable,
    WeightSyncError,
)
from ..types import EngineInfo

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("rollout_engines.group")

#: Errors that describe the request or the caller's use of the engine, not a broken engine:
#: raised to the caller as they are, never retried elsewhere.
CLIENT_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, TypeError, KeyError, CapabilityError, EngineAsleep, WeightSyncError,
)
#: Errors that say the engine itself cannot serve: the member is marked down at once.
ENGINE_FAILURES: tuple[type[BaseException], ...] = (
    EngineUnavailable, EngineClosed, ConnectionError, TimeoutError, asyncio.TimeoutError, OSError, EOFError,
)

NamedTensors = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]
RejoinCallback = Callable[[EngineProtocol, int], Awaitable[None]]
WeightSource = str | Path | Callable[[int], NamedTensors | Awaitable[NamedTensors]]


class _Member:
    """One engine of the group and what the router knows about it (plain attributes: hot path)."""

    __slots__ = (
        "engine", "index", "receivers", "outstanding", "completed", "failures", "version", "healthy",
        "serving", "in_session", "inflight", "waiters", "rejoining", "last_error", "warned_stale", "loras",
    )

    def __init__(self, engine: EngineProtocol, index: int) -> None:
        self.engine = engine
        self.index = index
        self.receivers = engine.weight_receivers()
        self.outstanding = 0
        self.completed = 0
        self.failures = 0
        self.version = int(getattr(engine, "weight_version", 0))
        self.healthy = True
        # healthy and at the group's weight version: may take traffic
        self.serving = True
        self.in_session = False
        self.inflight: set[asyncio.Task[Any]] = set()
        # sticky requests waiting for a slot on this member
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.rejoining = False
        self.last_error: str | None = None
        self.warned_stale = False
        # LoRA adapter -> the version this member applied (recorded only once it succeeded)
        self.loras: dict[str, int] = dict(getattr(engine, "loras", None) or {})

    def describe(self) -> dict[str, Any]:
        return {
            "index": self.index, "backend": self.engine.backend_name, "healthy": self.healthy,
            "serving": self.serving, "weight_version": self.version, "outstanding": self.outstanding,
            "completed": self.completed, "failures": self.failures, "in_session": self.in_session,
            "last_error": self.last_error, "loras": dict(self.loras),
        }


def intersect_capabilities(caps: Sequence[Capabilities]) -> Capabilities:
    """What every member can do: flags AND-ed (``multi_process``, which says where workers run,
    OR-ed), limits the smallest, tuples intersected (order of the first member)."""
    values: dict[str, Any] = {}
    for name in Capabilities.model_fields:
        got = [getattr(c, name) for c in caps]
        if isinstance(got[0], bool):
            values[name] = any(got) if name == "multi_process" else all(got)
        elif isinstance(got[0], int):
            values[name] = min(got)
        else:
            values[name] = tuple(v for v in got[0] if all(v in other for other in got[1:]))
    return Capabilities(**values)


class _Membership(Engine):
    """The members of an :class:`~rollout_engines.group.EngineGroup`: membership, health, rejoin."""

    # set by EngineGroup.__init__
    health_interval_s: float | None
    health_timeout_s: float
    on_rejoin: RejoinCallback | None
    weight_source: WeightSource | None
    rejoin_transport: str | None
    _members: list[_Member]
    _waiters: deque[asyncio.Future[None]]
    _evicted: set[asyncio.Task[Any]]
    _health_task: asyncio.Task[None] | None
    _weights_lock: asyncio.Lock | None
    # held while the group's pause/sleep state changes and while a member is brought in line with it
    _state_lock: asyncio.Lock
    _last_transport: str | None
    _sleep_state: tuple[int, list[str]] | None
    _produced: OrderedDict[str, int]

    # ---- membership ----------------------------------------------------------------------------
    @property
    def engines(self) -> list[EngineProtocol]:
        return [m.engine for m in self._members]

    def __len__(self) -> int:
        return len(self._members)

    def member_stats(self) -> list[dict[str, Any]]:
        """Per member: health, whether it serves, weight version, in-flight and completed counts."""
        return [m.describe() for m in self._members]

    async def add_engine(self, engine: EngineProtocol) -> int:
        """Add a member (e.g. a replacement). It takes traffic once healthy and at the group's
        weight version (brought there as described under *Rejoin*). Returns its index.

        The group's limits and sets (``lora``, ``max_loras``, ``top_logprobs``, ``pause_modes``, ...)
        narrow to what the new member also has; an engine that lacks a flag the group declares
        (``streaming``, ``chat``, ...) is refused with :class:`CapabilityError`."""
        self._check_not_closed()
        if any(m.engine is engine for m in self._members):
            raise ValueError("this engine is already a member of the group")
        self._refuse_lost_flags(engine, [*self.engines, engine])
        member = _Member(engine, len(self._members))
        member.serving = False
        member.healthy = False
        self._members.append(member)
        self._recompute_capabilities()
        self._ensure_started()
        await self._probe(member)
        return member.index

    async def replace_engine(self, index: int, engine: EngineProtocol) -> None:
        """Put ``engine`` in member ``index``'s place (e.g. for an actor Ray will not restart any
        more): the old engine's requests are retried on the others and it is closed; the new one
        keeps the index, so sticky sessions map to it, and takes traffic once at the group's
        weight version. The group's capabilities become those of the members afterwards (an engine
        lacking a flag the group declares is refused, as by :meth:`add_engine`)."""
        self._check_not_closed()
        if not 0 <= index < len(self._members):
            raise ValueError(f"no member {index}; the group has {len(self._members)}")
        if any(m.engine is engine for m in self._members):
            raise ValueError("this engine is already a member of the group")
        self._refuse_lost_flags(engine, [engine if i == index else e for i, e in enumerate(self.engines)])
        old = self._members[index]
        self._mark_down(old, "replaced")
        member = _Member(engine, index)
        member.serving = member.healthy = False
        self._members[index] = member
        self._recompute_capabilities()
        try:
            await old.engine.close()
        except Exception as exc:  # it is usually dead already
            logger.debug("engine group: closing replaced member %d: %r", index, exc)
        self._ensure_started()
        await self._probe(member)

    async def remove_engine(self, index: int) -> EngineProtocol:
        """Take member ``index`` out of the group and return its engine, not closed (close it, or
        give it to another group). Its in-flight and queued requests are retried on the others;
        the members after it move down one index. The group's capabilities become again what every
        remaining member can do, so they may rise (e.g. ``lora`` when the member with the smallest
        rank leaves). A collective weight sync (``gloo``, ``nccl``) fixed its members at connect
        time: close it and connect again."""
        self._check_not_closed()
        if not 0 <= index < len(self._members):
            raise ValueError(f"no member {index}; the group has {len(self._members)}")
        if len(self._members) == 1:
            raise ValueError("cannot remove the last engine of the group; close() or detach() the group instead")
        self._mark_down(self._members[index], "removed from the group")  # wakes its waiters, evicts its requests
        old = self._members.pop(index)
        for m in self._members[index:]:
            m.index -= 1
        # answered request id -> member index, for continue_from: follow the move, forget the removed
        for rid, i in list(self._produced.items()):
            if i == index:
                del self._produced[rid]
            elif i > index:
                self._produced[rid] = i - 1
        self._recompute_capabilities()
        return old.engine

    def _recompute_capabilities(self) -> None:
        """The group declares what every current member can do (down members included: they are
        still members and come back); called whenever the members change."""
        self.capabilities = intersect_capabilities([m.engine.capabilities for m in self._members])

    def _refuse_lost_flags(self, engine: EngineProtocol, engines: Sequence[EngineProtocol]) -> None:
        """Refuse ``engine`` joining if the group of ``engines`` (the members it would make) turns
        off a flag the group declares now: callers rely on those (limits and sets narrow instead)."""
        after = intersect_capabilities([e.capabilities for e in engines])
        lost = [f for f, v in self.capabilities if v is True and not getattr(after, f)]
        if lost:
            raise CapabilityError(
                f"cannot add a '{engine.backend_name}' engine: it lacks {lost} that the group declares; "
                "use an engine with those capabilities, or build a new group"
            )

    # ---- failures ------------------------------------------------------------------------------
    async def _is_engine_failure(self, member: _Member, error: BaseException) -> bool:
        """Decide whether ``error`` means the member is broken (mark it down, retry the request
        elsewhere) or is specific to the request (raise it to the caller)."""
        if not isinstance(error, ENGINE_FAILURES) and member.healthy:
            # An unexpected error: blame the engine only if it also fails its health check, so
            # one poisonous request cannot take down every member in turn. (A member that is
            # healthy but not serving, e.g. stale after a push it missed, is checked too; one
            # already marked down is not.)
            if await self._healthy(member):
                return False
        self._mark_down(member, error)
        return True

    def _mark_down(self, m: _Member, error: BaseException | str) -> None:
        m.last_error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if not m.healthy and not m.serving:
            return
        m.failures += 1
        m.healthy = m.serving = False
        logger.warning("engine group: member %d (%s) is down: %s", m.index, m.engine.backend_name, m.last_error)
        # Its in-flight requests are retried elsewhere now rather than when (if ever) it answers.
        for task in list(m.inflight):
            self._evicted.add(task)
            task.cancel()
        self._wake_all()  # requests waiting for this member re-route

    def _wake_all(self) -> None:
        for queue in [self._waiters, *(m.waiters for m in self._members)]:
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)

    # ---- health and rejoin ---------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        if self._health_task is None and self.health_interval_s is not None and not self._closed:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop(), name="roe-group-health")

    async def _health_loop(self) -> None:
        assert self.health_interval_s is not None
        while not self._closed:
            try:
                await self.check_health()
            except Exception:  # the loop must survive anything a member does
                logger.exception("engine group health check failed")
            await asyncio.sleep(self.health_interval_s)

    async def _healthy(self, m: _Member) -> bool:
        try:
            return bool(await asyncio.wait_for(m.engine.health(), self.health_timeout_s))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            m.last_error = f"health: {type(exc).__name__}: {exc}"
            return False

    async def check_health(self) -> list[bool]:
        """Probe every member now: mark failed ones down, bring returning ones back (after giving
        them the latest weights). Returns which members serve afterwards."""
        self._ensure_started()
        await asyncio.gather(*(self._probe(m) for m in list(self._members)))
        return [m.serving for m in self._members]

    async def _probe(self, m: _Member) -> None:
        if m.rejoining:
            return
        if not await self._healthy(m):
            self._mark_down(m, m.last_error or "health check failed")
            return
        try:
            info = await asyncio.wait_for(m.engine.info(), self.health_timeout_s)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._mark_down(m, exc)
            return
        if m.serving and info.weight_version == self.weight_version:
            if self._state_differs(info):  # e.g. restarted (by Ray) at the same version, unpaused and awake
                try:
                    await self._apply_group_state(m)
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:
                    logger.debug("engine group: member %d: keeping the group's state failed: %r", m.index, exc)
            return
        m.loras = dict(info.loras)  # what it holds now (a restarted member has lost its adapters)
        if m.serving:  # restarted between two checks (e.g. by Ray) with its initial weights
            self._mark_down(m, f"weight version went from {m.version} to {info.weight_version}")
            m.in_session = False
        m.healthy = True
        m.version = info.weight_version
        await self._rejoin(m)

    async def _rejoin(self, m: _Member) -> None:
        assert self._weights_lock is not None
        m.rejoining = True
        try:
            async with self._weights_lock:
                target = self.weight_version
                if m.version != target:
                    if not await self._bring_to_version(m, target):
                        return
                    info = await asyncio.wait_for(m.engine.info(), self.health_timeout_s)
                    m.version = info.weight_version
                    if m.version != target:
                        m.last_error = f"rejoin left it at v{m.version}, not v{target}"
                        logger.error("engine group: member %d %s", m.index, m.last_error)
                        return
                await self._apply_group_state(m)
            m.serving = True
            m.warned_stale = False
            logger.info("engine group: member %d serves again at weight v%d", m.index, m.version)
            self._wake_all()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            m.last_error = f"rejoin: {type(exc).__name__}: {exc}"
            logger.warning("engine group: member %d could not rejoin: %s", m.index, m.last_error)
        finally:
            m.rejoining = False

    async def _bring_to_version(self, m: _Member, version: int) -> bool:
        if self.on_rejoin is not None:
            await self.on_rejoin(m.engine, version)
            return True
        if self.weight_source is not None:
            await self._push_from_source(m, version)
            return True
        if not m.warned_stale:
            m.warned_stale = True
            logger.error(
                "engine group: member %d is healthy but has weight v%d, not the group's v%d; it gets no "
                "traffic. Pass on_rejoin= or weight_source= to EngineGroup so it can be brought up to date",
                m.index, m.version, version,
            )
        m.last_error = f"stale weights (v{m.version} < v{version}) and no on_rejoin / weight_source"
        return False

    async def _push_from_source(self, m: _Member, version: int) -> None:
        from ..weights.session import connect_weight_sync

        source = self.weight_source
        if isinstance(source, str | Path):
            tensors: Any = await asyncio.to_thread(_load_source_dir, Path(source), version)
        else:
            assert source is not None
            tensors = source(version)
            if asyncio.iscoroutine(tensors) or isinstance(tensors, Awaitable):
                tensors = await tensors
        transport = self.rejoin_transport or self._last_transport
        if transport is None:
            transport = next(iter(m.engine.capabilities.transports), "inproc")
        sync = await connect_weight_sync([m.engine], transport)
        try:
            await sync.push(tensors, version=version)
        finally:
            await sync.close()

    def _state_differs(self, info: EngineInfo) -> bool:
        """Whether a member (its ``info``) is paused or asleep otherwise than the group."""
        asleep = set(self._sleep_state[1]) if self._sleep_state is not None else set()
        return info.paused != self._paused or set(info.asleep) != asleep

    async def _apply_group_state(self, m: _Member) -> None:
        """Bring a member in line with the group's state, both ways: asleep and paused like the
        others, and woken and resumed if it missed the group's wake-up or resume while it was down.
        Under the state lock, so no fan-out of the group changes that state meanwhile; every wait
        (the lock, and each call to the member) is bounded by ``health_timeout_s`` (a rejoin that
        times out is tried again at the next check)."""
        bound = self.health_timeout_s
        await asyncio.wait_for(self._state_lock.acquire(), bound)
        try:
            info = await asyncio.wait_for(m.engine.info(), bound)
            level, tags = self._sleep_state if self._sleep_state is not None else (1, [])
            if awake := [t for t in info.asleep if t not in tags]:
                await asyncio.wait_for(m.engine.wake_up(awake), bound)
            if to_sleep := [t for t in tags if t not in info.asleep]:
                await asyncio.wait_for(m.engine.sleep(level, to_sleep), bound)
            if self._paused and not info.paused:
                await asyncio.wait_for(m.engine.pause(self._pause_mode or "wait"), bound)
            elif info.paused and not self._paused:
                await asyncio.wait_for(m.engine.resume(), bound)
        finally:
            self._state_lock.release()


def _load_source_dir(root: Path, version: int) -> Any:
    """The weights of ``version`` from a directory: the newest complete update the ``disk``
    transport left there (its version must be ``version``), else the directory's ``*.safetensors``."""
    from ..weights.checkpoint import load_checkpoint
    from ..weights.transports.disk import load_latest

    latest = load_latest(root)
    if latest is None:
        return load_checkpoint(root)
    manifest, tensors = latest
    if manifest.version != version:
        raise WeightSyncError(
            f"weight_source {root} holds v{manifest.version}, not the group's v{version}; push over the "
            "'disk' transport into that directory (or keep it current) so returning engines can catch up"
        )
    return tensors
