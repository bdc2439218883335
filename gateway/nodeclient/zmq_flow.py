"""Flow control for a ZMQ KV event subscriber: a bounded inbox, a pacer that hands the event loop
back, a bounded exponential backoff and a log throttle.

Why: ZMQ PUB/SUB has no back-pressure. A publisher sends as fast as it likes, and a socket whose
messages are ready answers ``await recv()`` at once, without the event loop ever running
anything else. So the subscriber reads its socket into a queue of bounded size (beyond it, the
consumer is behind: what waits is dropped and the worker resynchronised, rather than queued),
and gives the loop back after every few milliseconds of work, reading the socket at those
moments so that libzmq's own queue stays short.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from prefixgate.gateway.nodeclient.zmq_wire import MAX_FRAME_BYTES, MAX_PARTS, BadMessage, split_message

DRAIN_PARTS = 256  # message parts read from the socket at one pause, at most
DRAIN_S = 0.001  # ... and for at most this long (each read lets other threads have the GIL)


class Parts:
    """One multipart message as its parts are read: the first ``MAX_PARTS`` kept, the rest only
    counted (a message of a million parts costs no memory here)."""

    __slots__ = ("extra", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.extra = 0

    def add(self, part: bytes) -> None:
        if len(self.parts) < MAX_PARTS:
            self.parts.append(part)
        else:
            self.extra += 1

    def take(self, max_bytes: int) -> tuple[int, bytes]:
        """(seq, payload) of the message read, and start the next one; raises ``BadMessage``."""
        parts, extra = self.parts, self.extra
        self.parts, self.extra = [], 0
        return split_message(parts, extra, max_bytes)


class Inbox:
    """A SUB socket read into a queue of at most ``max_batches`` batches and ``max_bytes``. When
    more arrive the consumer is behind the publisher: the queue is dropped (``shed`` counts the
    batches) and ``next`` says so once, so the subscriber can start over from the next one."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        max_batches: int,
        max_bytes: int,
        on_bad: Callable[[BadMessage], None],
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self.sock = sock
        self.raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)  # read without waiting
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.max_frame_bytes = max_frame_bytes
        self.on_bad = on_bad
        self.queue: deque[tuple[int, bytes]] = deque()
        self.bytes = 0
        self.shed = 0
        self._msg = Parts()

    def drain(self, limit: int = DRAIN_PARTS, budget_s: float = DRAIN_S) -> None:
        """Read what the socket holds now, at most ``limit`` parts for at most ``budget_s`` (the
        rest waits for the next pause)."""
        deadline = time.monotonic() + budget_s
        for i in range(limit):
            if i % 16 == 15 and time.monotonic() >= deadline:
                return
            try:
                part = self.raw.recv(zmq.DONTWAIT)
            except zmq.Again:
                return
            self._add(part)

    def _add(self, part: bytes) -> None:
        self._msg.add(part)
        if self.raw.getsockopt(zmq.RCVMORE):
            return
        try:
            seq, payload = self._msg.take(self.max_frame_bytes)
        except BadMessage as e:
            self.on_bad(e)
            return
        self.queue.append((seq, payload))
        self.bytes += len(payload)
        if len(self.queue) > self.max_batches or self.bytes > self.max_bytes:
            self.shed += len(self.queue)
            self.queue.clear()
            self.bytes = 0

    async def next(self) -> tuple[int, bytes] | None:
        """The next batch, waiting for one; None once after batches were shed."""
        while True:
            if self.shed:
                return None
            if self.queue:
                seq, payload = self.queue.popleft()
                self.bytes -= len(payload)
                return seq, payload
            self._add(await self.sock.recv())  # the loop runs other tasks while none is there
            self.drain()


class Pacer:
    """``await pace()`` between steps of work: gives the event loop back once ``slice_s`` has
    gone by since it last did, running ``on_pause`` first (the inbox's drain)."""

    def __init__(self, slice_s: float, on_pause: Callable[[], None] | None = None) -> None:
        self.slice_s = slice_s
        self.on_pause = on_pause
        self._since = time.monotonic()

    async def __call__(self) -> None:
        if time.monotonic() - self._since < self.slice_s:
            return
        if self.on_pause is not None:
            self.on_pause()
        await asyncio.sleep(0)
        self._since = time.monotonic()


@dataclass(slots=True)
class Backoff:
    """Bounded exponential backoff: ``fail`` gives the next wait (``low_s``, doubling up to
    ``high_s``) and starts it; ``reset`` after a success."""

    low_s: float
    high_s: float
    current: float = 0.0
    until: float = 0.0

    def fail(self) -> float:
        self.current = min(self.high_s, max(self.low_s, 2 * self.current))
        self.until = time.monotonic() + self.current
        return self.current

    def reset(self) -> None:
        self.current = 0.0
        self.until = 0.0

    @property
    def waiting(self) -> bool:
        return time.monotonic() < self.until


class Throttle:
    """At most one log line per key every ``every_s``; ``__call__`` says whether to log now and
    how many were held back since the last one."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, key: str) -> int | None:
        now = time.monotonic()
        if now < self._next.get(key, 0.0):
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._next[key] = now + self.every_s
        return self._held.pop(key, 0)
