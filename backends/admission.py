"""Admission: at most ``max_running`` at once, at most ``max_queue`` waiting, else refuse.

The waiting are served in arrival order (``fcfs``), or by priority (``priority``, vLLM's
meaning: lower first), equal priorities in arrival order: the order is a ticket's key, (its
priority, or 0 under ``fcfs``; its place in line), and ``waiting`` is kept sorted by it.

Each ticket carries the tokens of work it stands for, so the node can report how much prefill
work is ahead of a new arrival (waiting tokens plus what running tickets still have to do,
assuming linear progress over their expected duration).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

POLICIES = ("fcfs", "priority")  # as vLLM's --scheduling-policy


class QueueFull(Exception):
    pass


@dataclass(slots=True, eq=False)
class Ticket:
    tokens: int
    enqueued: float
    started: float = 0.0
    expected_s: float = 0.0
    future: asyncio.Future[None] | None = None
    priority: int = 0  # lower is served earlier (``priority`` policy)
    place: int = 0  # in line: later arrivals (and turns given) have higher places

    @property
    def waited_s(self) -> float:
        return max(0.0, self.started - self.enqueued)

    def remaining_tokens(self, now: float) -> int:
        if self.expected_s <= 0:
            return 0 if self.started else self.tokens
        done = (now - self.started) / self.expected_s
        return int(self.tokens * max(0.0, 1.0 - done))


class Admission:
    def __init__(
        self,
        max_running: int,
        max_queue: int,
        clock: Callable[[], float] = time.monotonic,
        policy: str = "fcfs",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.max_running = max(1, max_running)
        self.max_queue = max(0, max_queue)
        self.clock = clock
        self.by_priority = policy == "priority"
        self.running: set[Ticket] = set()
        self.waiting: list[Ticket] = []  # in the order they are served
        self._places = itertools.count()

    def _key(self, t: Ticket) -> tuple[int, int]:
        return (t.priority if self.by_priority else 0, t.place)

    def _line_up(self, t: Ticket) -> None:
        """``t`` into line: behind every waiting ticket it does not go before."""
        t.place = next(self._places)
        bisect.insort(self.waiting, t, key=self._key)

    @property
    def queued_tokens(self) -> int:
        return sum(t.tokens for t in self.waiting)

    def work_tokens(self) -> int:
        """Tokens waiting plus the unfinished part of running tickets."""
        now = self.clock()
        return self.queued_tokens + sum(t.remaining_tokens(now) for t in self.running)

    async def acquire(self, tokens: int = 0, priority: int = 0) -> Ticket:
        """A running ticket, after waiting in line if need be; ``QueueFull`` when the line is full."""
        t = Ticket(tokens, self.clock(), priority=priority)
        if len(self.running) < self.max_running and not self.waiting:
            self._start(t)
            return t
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(
                f"queue full: {len(self.running)} running (max {self.max_running}),"
                f" {len(self.waiting)} waiting (max {self.max_queue})"
            )
        t.future = asyncio.get_running_loop().create_future()
        self._line_up(t)
        try:
            await t.future
        except asyncio.CancelledError:
            if t in self.running:  # granted just as we were cancelled
                self.release(t)
            elif t in self.waiting:
                self.waiting.remove(t)
            raise
        return t

    def yields_to(self, t: Ticket) -> bool:
        """Whether someone waiting goes before ``t`` once it steps back: anyone under ``fcfs``,
        one of no lower priority under ``priority``."""
        if not self.waiting:
            return False
        return not self.by_priority or self.waiting[0].priority <= t.priority

    async def yield_turn(self, t: Ticket) -> None:
        """A running ``t`` steps back behind everyone waiting that it does not go before (it was
        admitted: ``max_queue`` does not apply) and returns once it runs again; at once when
        nobody waiting would go first."""
        if t not in self.running or not self.yields_to(t):
            return
        t.future = asyncio.get_running_loop().create_future()
        self._line_up(t)
        self.release(t)  # starts the ones ahead of it
        try:
            await t.future
        except asyncio.CancelledError:
            if t in self.running:
                self.release(t)
            elif t in self.waiting:
                self.waiting.remove(t)
            raise

    def release(self, t: Ticket) -> None:
        if t not in self.running:
            return
        self.running.discard(t)
        while self.waiting and len(self.running) < self.max_running:
            nxt = self.waiting.pop(0)
            if nxt.future is None or nxt.future.done():
                continue
            self._start(nxt)
            nxt.future.set_result(None)

    def _start(self, t: Ticket) -> None:
        t.started = self.clock()
        self.running.add(t)

    @asynccontextmanager
    async def slot(self, tokens: int = 0, priority: int = 0) -> AsyncIterator[Ticket]:
        t = await self.acquire(tokens, priority)
        try:
            yield t
        finally:
            self.release(t)
