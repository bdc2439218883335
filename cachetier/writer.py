"""Batching index writer: keeps index writes off the request path.

Requests ``submit`` their ``StoreOp`` and return at once; a background task sends them to the
index in batches (one ``store`` call each, which the index applies atomically). The queue is
bounded: when it is full, new ops are dropped and counted rather than blocking a request — the
index is a routing hint, and node KV events reconcile it later.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType

import structlog

from prefixgate.cachetier.index import BlockIndex, StoreOp
from prefixgate.cachetier.tasks import stop_task

log = structlog.get_logger("prefixgate.cachetier.writer")


@dataclass(slots=True)
class WriterStats:
    submitted: int = 0
    dropped: int = 0
    written_ops: int = 0
    written_blocks: int = 0
    rejected_ops: int = 0  # stores the index refused (parent not held)
    failed_ops: int = 0  # lost to an index error
    batches: int = 0
    pending: int = 0


class IndexWriter:
    """Queue ``StoreOp``s and write them to ``index`` in batches, in submission order."""

    def __init__(
        self,
        index: BlockIndex,
        *,
        max_pending_ops: int = 10_000,
        max_pending_blocks: int = 4_000_000,
        batch_ops: int = 256,
        batch_blocks: int = 2048,
        interval: float = 0.005,
    ) -> None:
        self.index = index
        self.max_pending_ops = max_pending_ops
        self.max_pending_blocks = max_pending_blocks
        self.batch_ops = max(1, batch_ops)
        self.batch_blocks = max(1, batch_blocks)
        self.interval = interval
        self.stats = WriterStats()
        self._queue: deque[StoreOp] = deque()
        self._pending_blocks = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- producer side (never blocks) ---------------------------------------------------

    def submit(self, op: StoreOp) -> bool:
        """Queue one op; False (and counted as dropped) when the queue is full or closed."""
        n = len(op.hashes)
        if (
            self._closed
            or len(self._queue) >= self.max_pending_ops
            or (self._pending_blocks + n > self.max_pending_blocks and self._queue)
        ):
            self.stats.dropped += 1
            return False
        self._queue.append(op)
        self._pending_blocks += n
        self.stats.submitted += 1
        self._idle.clear()
        self._wake.set()
        self.start()
        return True

    def submit_many(self, ops: Iterable[StoreOp]) -> int:
        return sum(self.submit(op) for op in ops)

    @property
    def pending(self) -> int:
        return len(self._queue)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the background task (done by the first ``submit`` too)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="index-writer")

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every op submitted so far has been written (or failed)."""
        if self._queue:
            self.start()
            self._wake.set()
        async with asyncio.timeout(timeout):
            await self._idle.wait()

    async def close(self, timeout: float = 5.0) -> None:
        """Stop accepting ops, write what is queued (up to ``timeout``), stop the task."""
        self._closed = True
        with contextlib.suppress(TimeoutError):
            await self.flush(timeout)
        task, self._task = self._task, None
        await stop_task(task)  # cancelled until it ends: one cancellation can be lost in a Redis call
        if self._queue:
            self.stats.dropped += len(self._queue)
            self._queue.clear()
            self._pending_blocks = 0
        self._idle.set()

    async def __aenter__(self) -> IndexWriter:
        self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- consumer side -------------------------------------------------------------------

    def _take_batch(self) -> list[StoreOp]:
        batch: list[StoreOp] = []
        blocks = 0
        q = self._queue
        while q and len(batch) < self.batch_ops:
            n = len(q[0].hashes)
            if batch and blocks + n > self.batch_blocks:
                break
            batch.append(q.popleft())
            blocks += n
        self._pending_blocks -= blocks
        return batch

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if not self._closed and len(self._queue) < self.batch_ops and self.interval > 0:
                await asyncio.sleep(self.interval)  # let a batch gather
            while self._queue:
                batch = self._take_batch()
                await self._write(batch)
            self._wake.clear()
            if not self._queue:
                self._idle.set()

    async def _write(self, batch: list[StoreOp]) -> None:
        try:
            results = await self.index.store(batch)
        except Exception as exc:  # the index is a hint: never let a write error escape
            self.stats.failed_ops += len(batch)
            log.warning("index.write_failed", ops=len(batch), error=repr(exc))
            return
        finally:
            self.stats.batches += 1
            self.stats.pending = len(self._queue)
        ok = sum(results)
        self.stats.written_ops += ok
        self.stats.rejected_ops += len(batch) - ok
        self.stats.written_blocks += sum(len(op.hashes) for op, r in zip(batch, results, strict=True) if r)
