"""The scheduler's decisions over node views: start now, wait, or be refused early.

``Scheduler`` holds one model pool's ``WaitQueue`` and decides, from the views of the nodes
that compute prompts (``prefill_views``), what a new request does:

- **start** at once: nothing waits and a node has room (``room.has_room``), or no node is
  routable (nothing to wait for: the planner refuses it, as without a queue);
- **wait** in the queue, to leave by the queue's order when a node has room (``take``);
- **full**: the queue's bounds are reached (429 with ``Retry-After``), unless another tenant
  holds more of it: then its latest requests make room (``displaced``, refused instead);
- **shed**: its TTFT target cannot be met by the predicted wait and it is sheddable (429 now
  rather than a late answer);
- **late**: the same, but not sheddable: the caller serves it whole when that is faster
  (the TTFT budget rule, per request), else it waits like any other.

The predicted wait is the prefill work ahead of it (what the nodes hold and what the queue
serves first: ``WaitQueue.ahead_tokens``) over the pool's speed. Pure: the live gateway and the
trace simulator call the same methods with their own views and clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

from prefixgate.gateway.records import record
from prefixgate.gateway.routing.base import NodeView
from prefixgate.gateway.scheduling.queue import DEFAULT_LIMITS, Entry, QueueLimits, WaitQueue
from prefixgate.gateway.scheduling.room import DEFAULT_ROOM, RoomRule, has_room
from prefixgate.gateway.vocab import Role


class Verdict(StrEnum):
    START = "start"
    WAIT = "wait"
    FULL = "full"
    SHED = "shed"
    LATE = "late"


@record
class Admit:
    verdict: Verdict
    wait_s: float = 0.0  # predicted wait before its prefill starts
    reason: str = ""  # full, shed, late: why, in the client's words
    retry_after_s: float = 0.0  # full, shed: when a retry may find room


def prefill_views(views: Sequence[NodeView]) -> list[NodeView]:
    """The nodes that compute prompts: the prefill pool, else those serving whole requests."""
    prefill = [v for v in views if v.role == Role.PREFILL and v.routable]
    if prefill:
        return prefill
    mono = [v for v in views if v.role == Role.MONOLITHIC and v.routable]
    return mono or [v for v in views if v.role == Role.DECODE and v.routable]


def pool_rate(views: Sequence[NodeView]) -> float:
    """The pool's prefill tokens per second (0: no node states a speed)."""
    return sum(v.prefill_tokens_per_s for v in views if 0 < v.prefill_tokens_per_s < math.inf)


def backlog_tokens(views: Sequence[NodeView]) -> int:
    return sum(v.outstanding_tokens for v in views)


class Scheduler:
    def __init__(self, limits: QueueLimits = DEFAULT_LIMITS, room: RoomRule = DEFAULT_ROOM) -> None:
        self.queue = WaitQueue(limits)
        self.room = room
        self.displaced: list[Entry] = []  # taken out by ``hold`` to make room: to be refused

    @property
    def on(self) -> bool:
        """Whether requests are held at all (``max_requests`` of the room rule above 0)."""
        return self.room.max_requests > 0

    def can_start(self, views: Sequence[NodeView]) -> bool:
        """A node has room, or there is none to wait for (no routable node: the request goes on
        to be refused by the planner, as without a queue)."""
        return not views or any(has_room(v, self.room) for v in views)

    def predicted_wait_s(self, entry: Entry, views: Sequence[NodeView]) -> float:
        """Seconds before ``entry`` would start prefilling: what the nodes hold and what the
        queue serves first, over the pool's speed (fluid: the pool as one node). 0 when no
        node states a speed."""
        rate = pool_rate(views)
        if rate <= 0:
            return 0.0
        ahead = self.queue.ahead_tokens(entry.tenant, entry.schedule.priority, entry.cost_tokens)
        return (backlog_tokens(views) + ahead) / rate

    def arrive(self, entry: Entry, views: Sequence[NodeView], now: float, *, blocked: bool = False) -> Admit:
        """What a new request does (``views``: ``prefill_views`` of its pool; ``blocked``: the
        caller knows the room is taken already, by requests given their turn and not yet on a
        node). ``wait`` and a ``late`` the caller lets wait are queued by ``hold``; ``start``
        is not queued."""
        if not self.on or not views or (len(self.queue) == 0 and not blocked and self.can_start(views)):
            return Admit(Verdict.START)
        wait = self.predicted_wait_s(entry, views)
        due = entry.deadline_s
        if now + wait + entry.predicted_s > due:
            late = (
                f"its first token is due in {entry.schedule.ttft_slo_s * 1000:.0f} ms and the "
                f"predicted wait is {wait * 1000:.0f} ms"
            )
            if entry.schedule.sheddable:
                return Admit(Verdict.SHED, wait, late, retry_after_s=max(1.0, wait))
            return Admit(Verdict.LATE, wait, late)
        full = self.queue.full(entry.size_bytes)
        if full and not self.queue.displace(entry.tenant, entry.size_bytes, dry_run=True):
            return Admit(Verdict.FULL, wait, full, retry_after_s=max(1.0, wait))
        return Admit(Verdict.WAIT, wait)

    def hold(self, entry: Entry) -> str:
        """Queue ``entry``; the reason it cannot wait ("" once queued). In a full queue it may
        take the place of the latest requests of the tenant holding the most
        (``WaitQueue.displace``): those are in ``displaced`` for the caller to refuse."""
        full = self.queue.full(entry.size_bytes)
        if full:
            victims = self.queue.displace(entry.tenant, entry.size_bytes)
            if not victims:
                return full
            self.displaced.extend(victims)
        self.queue.push(entry)
        return ""

    def take(self, views: Sequence[NodeView], now: float) -> Entry | None:
        """The waiting request to start now, if a node has room (the caller dispatches it, so
        that the next call's views count it, and calls again)."""
        if len(self.queue) == 0 or not self.can_start(views):
            return None
        return self.queue.pop(now)

    def expire(self, now: float) -> list[Entry]:
        return self.queue.expired(now)
