"""The KV event log: every change of a node's block pool, numbered, for the gateway's index.

Sequence numbers are consecutive per ``instance_id`` (random per node start) and begin at 1.
A SNAPSHOT carries ``seq`` = the last change it includes, so the next event is ``seq + 1``.
The log keeps a bounded buffer; a follower asking for events older than the buffer (or
falling behind it, or asking for a seq this instance never issued) gets a fresh SNAPSHOT and
continues from there. Followers are woken at once on every change.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

DEFAULT_EVENT_BUFFER = 4096


class EventKind(enum.IntEnum):
    """Same numbers as ``prefixgate.v1.KVEvent.Kind``."""

    STORED = 0
    REMOVED = 1
    CLEARED = 2
    SNAPSHOT = 3


@dataclass(frozen=True, slots=True)
class KVEventRecord:
    seq: int
    kind: EventKind
    parent_hash: int = 0
    block_hashes: tuple[int, ...] = ()
    parent_hashes: tuple[int, ...] = ()


class EventLog:
    """A ``PoolListener`` that numbers pool changes and serves followers."""

    def __init__(
        self,
        snapshot: Callable[[], Sequence[tuple[int, int]]],
        buffer: int = DEFAULT_EVENT_BUFFER,
        instance_id: str | None = None,
    ) -> None:
        self.instance_id = instance_id or secrets.token_hex(8)
        self.seq = 0
        self._snapshot = snapshot
        self._buffer: deque[KVEventRecord] = deque(maxlen=max(1, buffer))
        self._changed = asyncio.Event()
        self._closed = False

    # -- PoolListener ------------------------------------------------------------------------

    def stored(self, parent: int, hashes: Sequence[int]) -> None:
        self._append(EventKind.STORED, parent, tuple(hashes))

    def removed(self, hashes: Sequence[int]) -> None:
        self._append(EventKind.REMOVED, 0, tuple(hashes))

    def cleared(self) -> None:
        self._append(EventKind.CLEARED, 0, ())

    def _append(self, kind: EventKind, parent: int, hashes: tuple[int, ...]) -> None:
        self.seq += 1
        self._buffer.append(KVEventRecord(self.seq, kind, parent, hashes))
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def close(self) -> None:
        """End every follower (node shutdown)."""
        self._closed = True
        self._wake()

    # -- followers ---------------------------------------------------------------------------

    def take_snapshot(self) -> KVEventRecord:
        pairs = self._snapshot()
        return KVEventRecord(
            self.seq,
            EventKind.SNAPSHOT,
            0,
            tuple(h for h, _ in pairs),
            tuple(p for _, p in pairs),
        )

    def since(self, last: int) -> list[KVEventRecord] | None:
        """Events after ``last`` from the buffer; None when they are no longer all there."""
        if last > self.seq:
            return None
        if last == self.seq:
            return []
        if not self._buffer or self._buffer[0].seq > last + 1:
            return None
        start = last + 1 - self._buffer[0].seq
        return [self._buffer[i] for i in range(start, len(self._buffer))]

    async def follow(self, since_seq: int = 0) -> AsyncGenerator[KVEventRecord, None]:
        """Events after ``since_seq``; a SNAPSHOT first when ``since_seq`` is 0 or out of reach."""
        last = since_seq
        first = since_seq == 0
        while not self._closed:
            waiter = self._changed
            pending = None if first else self.since(last)
            first = False
            if pending is None:
                snap = self.take_snapshot()
                last = snap.seq
                yield snap
                continue
            for rec in pending:
                last = rec.seq
                yield rec
            if last == self.seq:
                await waiter.wait()
