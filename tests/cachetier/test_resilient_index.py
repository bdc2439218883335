"""Degraded mode: Redis down or silent never fails a call; the index comes back by itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import structlog

from prefixgate.cachetier import open_index
from prefixgate.cachetier.index import StoreOp
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.redis_index import RedisIndex
from prefixgate.cachetier.resilient import MirrorWrites, ResilientIndex, mirror_writes
from tests.cachetier.support import TcpProxy, redis_url, test_prefix


@pytest.fixture
async def proxy(url: str) -> AsyncIterator[TcpProxy]:
    p = TcpProxy()
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


def resilient(url: str, **kw: Any) -> ResilientIndex:
    kw.setdefault("failures_to_degrade", 3)
    index = open_index(url, prefix=test_prefix(), lookup_timeout=0.05, probe_interval=0.05, **kw)
    assert isinstance(index, ResilientIndex)
    return index


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def purge_directly(primary: RedisIndex) -> None:
    """Delete the test's keys through a direct connection (the proxy may be down)."""
    direct = RedisIndex.from_url(redis_url(), prefix=primary.keys.prefix)
    try:
        await direct.purge()
    finally:
        await direct.close()


def test_factory_picks_the_implementation() -> None:
    assert isinstance(open_index(None), MemoryIndex)
    assert isinstance(open_index("memory"), MemoryIndex)
    with pytest.raises(ValueError):
        open_index("postgres://x")


async def test_dead_redis_serves_from_the_mirror_and_never_raises() -> None:
    index = resilient("redis://127.0.0.1:1/0", call_timeout=0.2)
    with structlog.testing.capture_logs() as logs:
        assert await index.store([StoreOp("a", (1, 2, 3))]) == [True]
        t0 = time.perf_counter()
        for _ in range(5):
            assert await index.lookup([1, 2, 3, 4], ["a", "b"]) == {"a": 3, "b": 0}
        assert time.perf_counter() - t0 < 2.0
        assert index.degraded
        assert await index.remove("a", [3]) == 1
        assert await index.clear_node("x") == 0
        await index.set_capacity("a", 10)
        await index.replace_node("b", [[7, 8]])
        assert await index.node_hashes("b") == {7, 8}
        stats = await index.stats()
        assert stats.degraded and stats.backend == "redis" and stats.total_blocks == 4
        await index.close()
    assert index.counters.degraded_lookups >= 5 and index.counters.dropped_writes >= 5
    assert [e["event"] for e in logs].count("index.degraded") == 1


async def test_without_a_mirror_degraded_lookups_are_empty() -> None:
    index = resilient("redis://127.0.0.1:1/0", mirror=False, failures_to_degrade=1)
    await index.store([StoreOp("a", (1,))])
    assert await index.lookup([1], ["a"]) == {"a": 0}
    assert await index.lookup([1]) == {}
    await index.close()


async def test_silent_redis_times_out_then_recovers(proxy: TcpProxy) -> None:
    resyncs: list[tuple[frozenset[str], str]] = []
    index = resilient(proxy.url, call_timeout=0.3, on_resync=lambda nodes, why: resyncs.append((nodes, why)))
    primary = index.primary
    assert isinstance(primary, RedisIndex)
    try:
        with structlog.testing.capture_logs() as logs:
            assert await index.store([StoreOp("a", (1, 2, 3))]) == [True]
            assert await index.lookup([1, 2, 3], ["a"]) == {"a": 3}
            assert not index.degraded

            proxy.blackhole = True  # Redis stops answering
            for _ in range(4):
                t0 = time.perf_counter()
                assert await index.lookup([1, 2, 3], ["a"]) == {"a": 3}  # from the mirror
                assert time.perf_counter() - t0 < 1.0
            # late lookups are not failures; the calls still running fail at call_timeout
            await wait_for(lambda: index.degraded, timeout=3.0)
            await index.store([StoreOp("a", (4,), parent=3)])  # mirror only; dropped for Redis
            assert await index.lookup([1, 2, 3, 4], ["a"]) == {"a": 4}
            dropped = index.counters.dropped_writes
            assert dropped >= 1

            proxy.blackhole = False  # Redis answers again: back without a restart
            await wait_for(lambda: not index.degraded)
            # only the node whose write Redis missed is resynced
            await wait_for(lambda: bool(resyncs))
            assert index.recovered.is_set() and resyncs == [(frozenset({"a"}), "recovered")]
            assert index.counters.recoveries == 1
            # Redis never saw the degraded write: the gateway resyncs nodes after `recovered`.
            # Asked of Redis itself: a lookup through the index that Redis answers later than
            # its 50 ms deadline (a loaded machine) is answered by the mirror, which has the block.
            assert await primary.lookup([1, 2, 3, 4], ["a"]) == {"a": 3}
        events = [e["event"] for e in logs]
        assert events.count("index.degraded") == 1 and events.count("index.recovered") == 1
    finally:
        await purge_directly(primary)
        await index.close()


async def test_redis_going_away_and_coming_back(proxy: TcpProxy) -> None:
    index = resilient(proxy.url, call_timeout=0.3)
    primary = index.primary
    assert isinstance(primary, RedisIndex)
    try:
        await index.store([StoreOp("a", (1, 2))])
        await proxy.stop()  # connections cut, port refuses
        for _ in range(4):
            assert await index.lookup([1, 2], ["a"]) == {"a": 2}
        assert index.degraded
        await proxy.start()  # same port again
        await wait_for(lambda: not index.degraded)
        assert await index.store([StoreOp("a", (3,), parent=2)]) == [True]
        assert await primary.lookup([1, 2, 3], ["a"]) == {"a": 3}
    finally:
        await purge_directly(primary)
        await index.close()


async def test_mirror_writes_reach_the_mirror_alone_and_read_the_shared_index(url: str) -> None:
    """A gateway worker that leaves the nodes' KV events to a sibling: its writes keep its
    mirror current, Redis sees only what the others write, and its lookups are Redis's."""
    index = resilient(url)
    view = mirror_writes(index)
    assert isinstance(view, MirrorWrites) and view.backend == "redis"
    primary = index.primary
    assert isinstance(primary, RedisIndex)
    try:
        await view.set_capacity("n", 100)
        assert await view.store([StoreOp("n", (1, 2, 3))]) == [True]
        await view.replace_node("m", [[7, 8]])
        assert await primary.lookup([1, 2, 3], ["n"]) == {"n": 0}  # nothing reached Redis
        assert await primary.node_hashes("m") == set()
        assert index.mirror is not None and index.mirror.lookup([1, 2, 3], ["n"]) == {"n": 3}
        assert index.mirror.lookup([7, 8], ["m"]) == {"m": 2}

        await index.store([StoreOp("n", (1, 2))])  # what the writing sibling put in Redis
        assert await view.lookup([1, 2, 3], ["n"]) == {"n": 2}  # read from Redis, not the mirror
        assert await view.remove("n", [3]) == 1 and await primary.lookup([1, 2], ["n"]) == {"n": 2}
        assert await view.clear_node("m") == 2 and await view.node_hashes("n") == {1, 2}
        await view.close()  # the index's owner closes it, not the view
        assert await index.lookup([1], ["n"]) == {"n": 1}
    finally:
        await primary.purge()
        await index.close()
    assert mirror_writes(MemoryIndex()).__class__ is MemoryIndex  # embedded: every write is its own
    no_mirror = resilient(url, mirror=False)
    assert mirror_writes(no_mirror) is no_mirror
    await no_mirror.close()
