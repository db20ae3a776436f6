"""Routing of an :class:`~rollout_engines.group.EngineGroup`: choosing the member a request goes
to (``round_robin``, ``least_outstanding``, ``sticky``; LoRA holders; a continued completion's
producer) and the queues requests wait in for a slot (backpressure)."""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from typing import Literal

from ..errors import EngineClosed, EngineUnavailable, InvalidRequest
from ..types import GenerateRequest
from .membership import _Member, _Membership

Routing = Literal["round_robin", "least_outstanding", "sticky"]
ROUTINGS: tuple[str, ...] = ("round_robin", "least_outstanding", "sticky")


class _Router(_Membership):
    """How an :class:`~rollout_engines.group.EngineGroup` picks a member for a request."""

    # set by EngineGroup.__init__
    routing: Routing
    max_outstanding: int | None
    wait_timeout_s: float | None
    _rr: int

    # ---- routing (hot path: keep it lean) --------------------------------------------------------
    def _pick(
        self, request: GenerateRequest, prefer: _Member | None = None
    ) -> tuple[_Member | None, deque[asyncio.Future[None]]]:
        """The member to send ``request`` to now, or None and the queue to wait in. ``prefer``
        (the producer of a continued completion) takes it while it serves. A request naming a LoRA
        adapter goes only to members that hold the group's version of it (:meth:`_holds`)."""
        lora = request.lora
        if lora is not None:
            return self._pick_holder(request, lora, prefer)
        if prefer is not None and prefer.serving:
            if self.max_outstanding is None or prefer.outstanding < self.max_outstanding:
                return prefer, prefer.waiters
            return None, prefer.waiters
        members = self._members
        n = len(members)
        if self.routing == "sticky" and request.session_id is not None:
            start = zlib.crc32(request.session_id.encode()) % n
            for k in range(n):
                m = members[(start + k) % n]
                if m.serving:  # the first member that can serve owns the session
                    if self.max_outstanding is None or m.outstanding < self.max_outstanding:
                        return m, m.waiters
                    return None, m.waiters
            return None, self._waiters
        start = self._rr
        self._rr = start + 1
        limit = self.max_outstanding
        if self.routing == "round_robin":
            for k in range(n):
                m = members[(start + k) % n]
                if m.serving and (limit is None or m.outstanding < limit):
                    return m, self._waiters
            return None, self._waiters
        best: _Member | None = None
        for k in range(n):  # least outstanding; the rotating start spreads ties
            m = members[(start + k) % n]
            if m.serving and (limit is None or m.outstanding < limit) and (best is None or m.outstanding < best.outstanding):
                best = m
        return best, self._waiters

    def _pick_holder(
        self, request: GenerateRequest, lora: str, prefer: _Member | None
    ) -> tuple[_Member | None, deque[asyncio.Future[None]]]:
        """:meth:`_pick` among the members that hold adapter ``lora`` (off the hot path)."""
        limit = self.max_outstanding
        holders = [m for m in self._members if self._holds(m, lora)]
        if prefer is not None and prefer in holders and prefer.serving:
            return (prefer if limit is None or prefer.outstanding < limit else None), prefer.waiters
        if self.routing == "sticky" and request.session_id is not None and holders:
            start = zlib.crc32(request.session_id.encode()) % len(holders)
            holders = holders[start:] + holders[:start]
            owner = next((m for m in holders if m.serving), None)
            if owner is None:
                return None, self._waiters
            return (owner if limit is None or owner.outstanding < limit else None), owner.waiters
        free = [m for m in holders if m.serving and (limit is None or m.outstanding < limit)]
        return min(free, key=lambda m: m.outstanding, default=None), self._waiters

    def _holds(self, m: _Member, lora: str) -> bool:
        """Whether member ``m`` serves adapter ``lora`` at the group's version of it: it applied
        that version (the group's record) and still has it (the engine's own, where it keeps one)."""
        version = self.loras.get(lora)
        return version is not None and m.loras.get(lora) == version and \
            getattr(m.engine, "loras", m.loras).get(lora) == version

    def _check_lora(self, request: GenerateRequest) -> None:
        lora = request.lora
        if lora is not None and not any(self._holds(m, lora) for m in self._members):
            raise InvalidRequest(f"no engine of the group holds LoRA adapter '{lora}'"
                                 f"{f' v{self.loras[lora]}' if lora in self.loras else ''}; push it again "
                                 "(WeightSync.push_lora)")

    async def _wait(self, request: GenerateRequest, deadline: float | None, prefer: _Member | None = None) -> _Member:
        """Queue, in arrival order, for a slot (or for a member to come back). A request woken but
        beaten to the slot goes back to the front of its queue."""
        loop = asyncio.get_running_loop()
        _, queue = self._pick(request, prefer)
        front = False
        while True:
            if self._closed:
                raise EngineClosed("the engine group was closed while a request waited")
            fut: asyncio.Future[None] = loop.create_future()
            if front:
                queue.appendleft(fut)
            else:
                queue.append(fut)
            woken = False
            try:
                if deadline is None:
                    await fut
                else:
                    left = deadline - loop.time()
                    if left <= 0:
                        raise asyncio.TimeoutError
                    await asyncio.wait_for(fut, left)
                woken = True
            except asyncio.TimeoutError:
                serving = sum(m.serving for m in self._members)
                raise EngineUnavailable(
                    f"no engine of the group could take the request within {self.wait_timeout_s} s "
                    f"({serving}/{len(self._members)} serving, at most {self.max_outstanding} in flight each); "
                    "raise max_outstanding_per_engine or wait_timeout_s, or add engines"
                ) from None
            finally:
                if not fut.done():
                    fut.cancel()
                    try:
                        queue.remove(fut)
                    except ValueError:
                        pass
                elif not woken and not fut.cancelled():
                    self._wake_one(queue)  # woken, then cancelled: hand the wake-up on
            member, queue = self._pick(request, prefer)
            if member is not None:
                return member
            front = True

    def _wake_one(self, queue: deque[asyncio.Future[None]]) -> bool:
        while queue:
            fut = queue.popleft()
            if not fut.done():
                fut.set_result(None)
                return True
        return False

    def _release(self, m: _Member) -> None:
        # a freed slot goes to a request stuck to this member first, then to any request
        if (m.waiters or self._waiters) and not self._wake_one(m.waiters):
            self._wake_one(self._waiters)
