"""Degraded mode only on real trouble: late lookups, write refusals and lost data, unit-tested.

The primary here is a scripted fake over ``MemoryIndex`` (slow, failing or forgetful on demand),
so these tests are deterministic; the real-Redis versions are in ``test_redis_faults.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from prefixgate.cachetier.index import StoreOp
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.resilient import ResilientIndex

DEADLINE = 0.05
SLOW = 0.2  # four deadlines: late by any measure, yet well inside call_timeout


class ScriptedRedis(MemoryIndex):
    """A primary that can be made slow, unreachable, write-refusing, or forgetful."""

    backend = "redis"

    def __init__(self) -> None:
        super().__init__()
        self.delay = 0.0
        self.down = False
        self.refuse_writes = False
        self.lost: set[str] = set()
        self.lookups = 0

    async def _gate(self, write: bool = False) -> None:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.down:
            raise RedisConnectionError("connection refused")
        if write and self.refuse_writes:
            raise ResponseError("OOM command not allowed when used memory > 'maxmemory'.")

    async def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None = None) -> dict[str, int]:
        self.lookups += 1
        await self._gate()
        return await super().lookup(hashes, nodes)

    async def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        await self._gate(write=True)
        return await super().store(ops)

    async def ping(self) -> None:
        await self._gate()

    async def check(self, *, write: bool = False) -> set[str]:
        await self._gate(write=write)
        lost, self.lost = self.lost, set()
        return lost


def wrapped(
    primary: ScriptedRedis, resyncs: list[tuple[frozenset[str], str]], sustained_late_s: float = 5.0
) -> ResilientIndex:
    return ResilientIndex(
        primary,
        lookup_timeout=DEADLINE,
        call_timeout=1.0,
        probe_interval=0.02,
        check_interval=0.02,
        failures_to_degrade=3,
        on_resync=lambda nodes, why: resyncs.append((nodes, why)),
        sustained_late_s=sustained_late_s,
    )


async def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_late_lookups_are_served_locally_and_are_not_a_failure_of_redis() -> None:
    """A loaded gateway misses the lookup deadline over and over while Redis is healthy:
    no degraded period, no recovery, no resync (each used to resync every node)."""
    primary = ScriptedRedis()
    resyncs: list[tuple[frozenset[str], str]] = []
    index = wrapped(primary, resyncs)
    try:
        await index.store([StoreOp("a", (1, 2, 3)), StoreOp("b", (1,))])
        primary.delay = SLOW
        with structlog.testing.capture_logs() as logs:
            for _ in range(10):
                assert await index.lookup([1, 2, 3], ["a", "b"]) == {"a": 3, "b": 1}  # the mirror
            await asyncio.sleep(SLOW + 0.1)  # the late calls finish: Redis answered
        assert index.counters.late_lookups == 10
        assert index.counters.degraded_periods == 0 and index.counters.recoveries == 0
        assert not index.degraded and resyncs == []
        assert "index.degraded" not in [e["event"] for e in logs]
        primary.delay = 0.0
        assert await index.lookup([1, 2], ["a"]) == {"a": 2}
    finally:
        await index.close()


async def test_lookups_late_without_a_break_degrade_once_and_do_not_flap() -> None:
    primary = ScriptedRedis()
    resyncs: list[tuple[frozenset[str], str]] = []
    index = wrapped(primary, resyncs, sustained_late_s=0.3)
    try:
        await index.store([StoreOp("a", (1, 2))])
        primary.delay = SLOW
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            assert await index.lookup([1, 2], ["a"]) == {"a": 2}
        assert index.degraded
        calls = primary.lookups
        for _ in range(20):  # degraded: Redis is not asked, answers stay right
            assert await index.lookup([1, 2], ["a"]) == {"a": 2}
        assert primary.lookups == calls
        await asyncio.sleep(0.5)  # the probe answers, but slower than a lookup may be: stay
        assert index.degraded and index.counters.recoveries == 0
        primary.delay = 0.0
        await wait_for(lambda: not index.degraded)
        assert index.counters.degraded_periods == 1 and index.counters.recoveries == 1
        assert resyncs == []  # no write was missed: nothing to resync
    finally:
        await index.close()


async def test_recovery_resyncs_only_the_nodes_whose_writes_redis_missed() -> None:
    primary = ScriptedRedis()
    resyncs: list[tuple[frozenset[str], str]] = []
    index = wrapped(primary, resyncs)
    try:
        await index.store([StoreOp("a", (1,)), StoreOp("b", (5,)), StoreOp("c", (9,))])
        primary.down = True
        for _ in range(3):
            assert await index.lookup([1], ["a"]) == {"a": 1}
        assert index.degraded
        await index.store([StoreOp("a", (2,), parent=1)])  # dropped for Redis: "a" is behind
        await index.remove("b", [5])  # "b" too; "c" saw no write
        assert index.missed_nodes == {"a", "b"}
        primary.down = False
        await wait_for(lambda: bool(resyncs))
        assert resyncs == [(frozenset({"a", "b"}), "recovered")]
        assert index.counters.resynced_nodes == 2
    finally:
        await index.close()


async def test_refused_writes_degrade_even_while_reads_succeed() -> None:
    """maxmemory + noeviction: reads work, every write is refused. That is not healthy."""
    primary = ScriptedRedis()
    resyncs: list[tuple[frozenset[str], str]] = []
    index = wrapped(primary, resyncs)
    try:
        primary.refuse_writes = True
        with structlog.testing.capture_logs() as logs:
            for i in range(3):
                await index.lookup([100 + i], ["a"])  # reads reach Redis and succeed...
                await index.store([StoreOp("a", (100 + i,))])  # ...writes are refused
            assert primary.lookups == 3
            assert index.degraded
            assert index.counters.failed_writes == 3
            await asyncio.sleep(0.2)  # the probe must write too: Redis still refuses, stay
            assert index.degraded and index.counters.recoveries == 0
            primary.refuse_writes = False
            await wait_for(lambda: bool(resyncs))
        assert resyncs == [(frozenset({"a"}), "recovered")]
        events = [e["event"] for e in logs]
        assert events.count("index.degraded") == 1 and events.count("index.recovered") == 1
        assert "index.write_failed" in events
        assert (await index.stats()).health["failed_writes"] == 3
    finally:
        await index.close()


async def test_a_single_failed_write_resyncs_that_node_without_degrading() -> None:
    primary = ScriptedRedis()
    resyncs: list[tuple[frozenset[str], str]] = []
    index = wrapped(primary, resyncs)
    try:
        primary.refuse_writes = True
        await index.store([StoreOp("b", (7,))])
        primary.refuse_writes = False
        await wait_for(lambda: bool(resyncs))
        assert resyncs == [(frozenset({"b"}), "write_failed")] and not index.degraded
    finally:
        await index.close()


async def test_nodes_whose_data_redis_lost_are_resynced() -> None:
    primary = ScriptedRedis()
    resyncs: list[tuple[frozenset[str], str]] = []
    index = wrapped(primary, resyncs)
    try:
        await index.store([StoreOp("a", (1,)), StoreOp("b", (2,))])
        primary.lost = {"b"}
        await wait_for(lambda: bool(resyncs))
        assert resyncs == [(frozenset({"b"}), "data_lost")]
        assert index.counters.data_losses == 1 and not index.degraded
    finally:
        await index.close()
