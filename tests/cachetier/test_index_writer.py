"""The batching writer: off the request path, bounded, batched, flushable, shut down cleanly."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from prefixgate.cachetier.index import StoreOp
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.redis_index import RedisIndex
from prefixgate.cachetier.writer import IndexWriter


class CountingIndex(MemoryIndex):
    """A real MemoryIndex that records the size of every batch it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    async def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        self.batches.append(len(ops))
        return await super().store(ops)


async def test_ops_are_batched_and_written_in_order() -> None:
    index = CountingIndex()
    async with IndexWriter(index, batch_ops=50, interval=0.01) as writer:
        for i in range(1, 121):
            assert writer.submit(StoreOp("n", (i,), parent=i - 1 if i > 1 else 0))
        await writer.flush(timeout=5)
        assert writer.stats.written_ops == 120 and writer.stats.rejected_ops == 0
    # each fragment needs the previous one: only in-order writing makes all 120 succeed
    assert await index.lookup(list(range(1, 121))) == {"n": 120}
    assert max(index.batches) == 50 and sum(index.batches) == 120 and len(index.batches) <= 5


async def test_batches_are_bounded_in_blocks_too() -> None:
    index = CountingIndex()
    async with IndexWriter(index, batch_ops=100, batch_blocks=1000) as writer:
        writer.submit_many(StoreOp(f"n{i}", tuple(range(1, 401))) for i in range(10))
        await writer.flush(timeout=5)
    assert index.batches == [2, 2, 2, 2, 2]


async def test_a_full_queue_drops_instead_of_blocking() -> None:
    index = MemoryIndex()
    writer = IndexWriter(index, max_pending_ops=10, interval=0.05)
    accepted = writer.submit_many(StoreOp("n", (i,)) for i in range(1, 26))
    assert accepted == 10 and writer.stats.dropped == 15
    await writer.flush(timeout=5)
    assert writer.stats.written_ops == 10
    assert writer.submit(StoreOp("n", (99,)))  # room again
    await writer.close()
    assert not writer.submit(StoreOp("n", (100,)))  # closed: dropped, counted
    assert writer.stats.dropped == 16
    assert len(await index.node_hashes("n")) == 11


async def test_close_writes_what_is_queued() -> None:
    index = MemoryIndex()
    writer = IndexWriter(index, interval=0.5)
    writer.submit(StoreOp("n", (1, 2, 3)))
    await writer.close(timeout=5)
    assert await index.lookup([1, 2, 3]) == {"n": 3}


async def test_index_errors_are_counted_not_raised(url: str) -> None:
    index = RedisIndex.from_url("redis://127.0.0.1:1/0")
    writer = IndexWriter(index, interval=0)
    writer.submit(StoreOp("n", (1,)))
    await writer.flush(timeout=10)
    assert writer.stats.failed_ops == 1 and writer.stats.written_ops == 0
    await writer.close()
    await index.close()


@pytest.mark.parametrize("interval", [0.0, 0.002])
async def test_through_redis(rindex: RedisIndex, interval: float) -> None:
    async with IndexWriter(rindex, interval=interval, batch_ops=8) as writer:
        for i in range(40):
            writer.submit(StoreOp(f"n{i % 3}", tuple(range(i * 100 + 1, i * 100 + 51))))
        await writer.flush(timeout=10)
        assert writer.stats.written_blocks == 40 * 50
    stats = await rindex.stats()
    assert stats.total_blocks == 40 * 50
