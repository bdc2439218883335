"""The KV event log: snapshot, consecutive seq, replay, resync when out of reach."""

from __future__ import annotations

import asyncio

from prefixgate.backends.events import EventKind, EventLog, KVEventRecord
from prefixgate.backends.pool import BlockPool


def make(buffer: int = 100) -> tuple[BlockPool[None], EventLog]:
    holder: list[BlockPool[None]] = []
    log = EventLog(lambda: holder[0].snapshot(), buffer=buffer)
    pool: BlockPool[None] = BlockPool(100, listener=log)
    holder.append(pool)
    return pool, log


def put(pool: BlockPool[None], chain: list[int]) -> None:
    k = pool.acquire(chain)
    pool.reserve(len(chain) - k)
    pool.commit(chain, k, [None] * (len(chain) - k), len(chain) - k)
    pool.release(chain)


async def take(it: object, n: int) -> list[KVEventRecord]:
    out = []
    for _ in range(n):
        out.append(await asyncio.wait_for(it.__anext__(), 2))  # type: ignore[attr-defined]
    return out


async def test_snapshot_then_live_events() -> None:
    pool, log = make()
    put(pool, [1, 2])
    put(pool, [1, 3])
    follower = log.follow(0)
    (snap,) = await take(follower, 1)
    assert snap.kind == EventKind.SNAPSHOT and snap.seq == 2
    assert snap.block_hashes == (1, 2, 3) and snap.parent_hashes == (0, 1, 1)
    nxt = asyncio.ensure_future(follower.__anext__())
    await asyncio.sleep(0)
    put(pool, [1, 2, 4])
    stored = await asyncio.wait_for(nxt, 2)
    assert (stored.seq, stored.kind, stored.parent_hash, stored.block_hashes) == (
        3,
        EventKind.STORED,
        2,
        (4,),
    )
    pool.evict([2])
    (removed,) = await take(follower, 1)
    assert (removed.seq, removed.kind, set(removed.block_hashes)) == (4, EventKind.REMOVED, {2, 4})
    await follower.aclose()


async def test_replay_from_seq_and_resync_when_out_of_buffer() -> None:
    pool, log = make(buffer=3)
    for i in range(1, 6):
        put(pool, [i])
    assert log.seq == 5
    # Seq 3 onward is still buffered: plain replay.
    follower = log.follow(3)
    assert [r.seq for r in await take(follower, 2)] == [4, 5]
    await follower.aclose()
    # Seq 1 is gone from the buffer: snapshot first.
    follower = log.follow(1)
    (snap,) = await take(follower, 1)
    assert snap.kind == EventKind.SNAPSHOT and snap.seq == 5 and len(snap.block_hashes) == 5
    await follower.aclose()
    # A seq this instance never issued (another instance's): snapshot.
    follower = log.follow(99)
    assert (await take(follower, 1))[0].kind == EventKind.SNAPSHOT
    await follower.aclose()


async def test_close_ends_followers() -> None:
    _, log = make()
    follower = log.follow(0)
    await take(follower, 1)
    nxt = asyncio.ensure_future(follower.__anext__())
    await asyncio.sleep(0)
    log.close()
    try:
        await asyncio.wait_for(nxt, 2)
    except StopAsyncIteration:
        pass
    else:  # pragma: no cover
        raise AssertionError("follower did not end")
