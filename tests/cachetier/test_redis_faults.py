"""A private redis-server restarted empty, or out of memory: the index notices and recovers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
import structlog

from prefixgate.cachetier import open_index
from prefixgate.cachetier.index import StoreOp
from prefixgate.cachetier.redis_index import RedisIndex
from prefixgate.cachetier.resilient import ResilientIndex
from tests.cachetier.support import PrivateRedis, test_prefix

Resyncs = list[tuple[frozenset[str], str]]


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    server = PrivateRedis().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def small_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis("--maxmemory", "3mb", "--maxmemory-policy", "noeviction").start()
    try:
        yield server
    finally:
        server.stop()


def resilient(url: str, resyncs: Resyncs) -> ResilientIndex:
    index = open_index(
        url,
        prefix=test_prefix(),
        lookup_timeout=0.5,
        call_timeout=0.5,
        probe_interval=0.05,
        failures_to_degrade=3,
        on_resync=lambda nodes, why: resyncs.append((nodes, why)),
    )
    assert isinstance(index, ResilientIndex)
    index.check_interval = 0.05
    return index


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_an_idle_restart_is_noticed_and_only_then_resynced(redis_server: PrivateRedis) -> None:
    resyncs: Resyncs = []
    index = resilient(redis_server.url, resyncs)
    try:
        await index.set_capacity("p", 5121)
        await index.store([StoreOp("p", (1, 2, 3)), StoreOp("q", (7, 8))])
        await asyncio.sleep(0.3)
        assert resyncs == []  # healthy: nothing to resync
        with structlog.testing.capture_logs() as logs:
            redis_server.restart()  # idle: nobody writes or looks up
            await wait_for(lambda: bool(resyncs))
        assert resyncs == [(frozenset({"p", "q"}), "data_lost")]
        assert "index.data_lost" in [e["event"] for e in logs]
        assert index.counters.data_losses == 2 and not index.degraded
        # what the gateway's resync does: snapshot capacity first, then the node's blocks
        await index.set_capacity("p", 5121)
        await index.replace_node("p", [[1, 2, 3]])
        await index.replace_node("q", [[7, 8]])
        stats = await index.stats()
        assert stats.nodes["p"].blocks == 3 and stats.nodes["p"].capacity == 5121
        assert await index.lookup([1, 2, 3], ["p", "q"]) == {"p": 3, "q": 0}
        await asyncio.sleep(0.3)
        assert len(resyncs) == 1  # the resync itself is not mistaken for another loss
    finally:
        await index.close()


async def test_the_first_write_after_a_restart_restores_capacity_and_reports_the_loss(
    redis_server: PrivateRedis,
) -> None:
    index = RedisIndex.from_url(redis_server.url, prefix=test_prefix())
    try:
        await index.set_capacity("p", 5121)
        await index.store([StoreOp("p", (1, 2))])
        redis_server.restart()
        assert await index.store([StoreOp("p", (5, 6))]) == [True]  # before any check ran
        stats = await index.stats()
        assert stats.nodes["p"].capacity == 5121  # not the 1,048,576 default
        assert await index.check() == {"p"}
        assert await index.check() == set()
    finally:
        await index.close()


async def test_another_replica_recreating_the_node_does_not_hide_the_loss(redis_server: PrivateRedis) -> None:
    prefix = test_prefix()
    a = RedisIndex.from_url(redis_server.url, prefix=prefix)
    b = RedisIndex.from_url(redis_server.url, prefix=prefix)
    try:
        await a.store([StoreOp("p", (1, 2))])
        redis_server.restart()
        await b.store([StoreOp("p", (9,))])  # b never knew the node: a new epoch, silently
        assert await a.check() == {"p"}
    finally:
        await a.close()
        await b.close()


async def test_out_of_memory_refusing_writes_is_degraded_mode_not_health(small_redis: PrivateRedis) -> None:
    resyncs: Resyncs = []
    index = resilient(small_redis.url, resyncs)
    try:
        with structlog.testing.capture_logs() as logs:
            for i in range(400):  # ~8 KB per store: fills 3 MB, then every write is refused
                chain = tuple(range(i * 1000 + 1, i * 1000 + 1001))
                await index.store([StoreOp(f"n{i % 4}", chain)])
                await index.lookup(chain[:10], ["n0", "n1"])  # reads keep working meanwhile
                if index.degraded:
                    break
            assert index.degraded, small_redis.cli("info", "memory")
            failed = index.counters.failed_writes
            assert failed >= 3
            assert (await index.stats()).health["failed_writes"] == failed
            await asyncio.sleep(0.3)  # the probe writes too: still refused, still degraded
            assert index.degraded and index.counters.recoveries == 0
            resyncs.clear()  # a failed write may have asked for its node's resync already
            assert small_redis.cli("config", "set", "maxmemory", "0") == "OK"
            await wait_for(lambda: bool(resyncs))
        assert not index.degraded and index.counters.recoveries == 1
        nodes, why = resyncs[0]
        assert why == "recovered" and nodes <= {"n0", "n1", "n2", "n3"} and nodes
        events = [e["event"] for e in logs]
        assert "index.write_failed" in events and events.count("index.degraded") == 1
    finally:
        await index.close()
