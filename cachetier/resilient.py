"""Degraded mode: a Redis outage degrades routing, never requests.

``ResilientIndex`` wraps a shared index (Redis) with a lookup deadline and a local mirror (an
``IndexCore`` fed with the same writes). No method raises because of Redis.

- A lookup that misses its deadline is answered from the mirror, but it is **late, not failed**:
  the Redis call runs on in the background and, if Redis answers within ``call_timeout``, Redis
  counts as healthy. A loaded gateway (event-loop lag) therefore never flaps into degraded mode.
- **Degraded mode** is entered on real errors only: ``failures_to_degrade`` consecutive failed
  reads, or as many consecutive failed writes (a Redis that answers reads but refuses writes,
  e.g. ``maxmemory`` + ``noeviction``, is not healthy), or lookups late without a break for
  ``sustained_late_s``. While degraded, lookups come from the mirror, writes reach the mirror
  only, and Redis is probed every ``probe_interval``; the probe must also prove that Redis
  accepts writes, and after a lateness episode that it answers within the lookup deadline.
- **Resync only what was missed**: the nodes whose writes Redis did not get (dropped while
  degraded, or failed) are remembered; the nodes whose data Redis lost (restart, flush,
  failover to a replica that lacked writes) are found by each node's epoch, checked every
  ``check_interval``. ``on_resync(nodes, reason)`` receives exactly those nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol, TypeVar

import structlog

from prefixgate.cachetier.index import DEFAULT_CAPACITY_BLOCKS, BlockIndex, IndexStats, StoreOp
from prefixgate.cachetier.memory import IndexCore
from prefixgate.cachetier.tasks import stop_tasks

log = structlog.get_logger("prefixgate.cachetier.resilient")

T = TypeVar("T")

ResyncHook = Callable[[frozenset[str], str], Awaitable[None] | None]

_MAX_LATE_IN_FLIGHT = 32  # late lookups still running against Redis; beyond that, mirror only


class _Failed:
    """Marks a primary call that errored or missed its deadline."""


FAILED = _Failed()


class ProbedIndex(BlockIndex, Protocol):
    """A shared index that can be pinged and asked which nodes lost their data (``RedisIndex``)."""

    async def ping(self) -> None: ...

    async def check(self, *, write: bool = False) -> set[str]:
        """Nodes whose data the store lost since last seen; ``write`` also proves writes work."""
        ...


@dataclass(slots=True)
class ResilienceStats:
    degraded_lookups: int = 0  # lookups answered from the mirror (or empty), late ones included
    late_lookups: int = 0  # lookups past the deadline: served from the mirror, not a Redis failure
    failed_calls: int = 0  # calls to the primary that errored or exceeded call_timeout
    failed_writes: int = 0  # writes Redis refused or never answered (down, OOM)
    dropped_writes: int = 0  # writes the primary never received (failed, or dropped while degraded)
    degraded_periods: int = 0
    recoveries: int = 0
    data_losses: int = 0  # nodes found to have lost their data in the store
    resynced_nodes: int = 0  # nodes handed to ``on_resync``


class ResilientIndex:
    """``BlockIndex`` over a primary index with a deadline, a local mirror and self-recovery."""

    def __init__(
        self,
        primary: ProbedIndex,
        *,
        mirror: bool = True,
        default_capacity: int = DEFAULT_CAPACITY_BLOCKS,
        lookup_timeout: float = 0.005,
        call_timeout: float = 1.0,
        probe_interval: float = 0.5,
        failures_to_degrade: int = 5,
        sustained_late_s: float = 5.0,
        check_interval: float = 1.0,
        on_resync: ResyncHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.primary = primary
        self.backend = primary.backend
        self.mirror: IndexCore | None = IndexCore(default_capacity) if mirror else None
        self.lookup_timeout = lookup_timeout
        self.call_timeout = call_timeout
        self.probe_interval = probe_interval
        self.failures_to_degrade = max(1, failures_to_degrade)
        self.sustained_late_s = sustained_late_s
        self.check_interval = check_interval
        self.on_resync = on_resync
        self.clock = clock
        self.counters = ResilienceStats()
        self.recovered = asyncio.Event()  # set on each recovery
        self._degraded = False
        self._degraded_by_lateness = False
        self._read_failures = 0
        self._write_failures = 0
        self._late_since: float | None = None
        self._late_in_flight = 0
        self._missed: set[str] = set()  # nodes whose writes Redis did not get
        self._watch: asyncio.Task[None] | None = None
        self._background: set[asyncio.Future[Any]] = set()
        self._closed = False

    @property
    def degraded(self) -> bool:
        return self._degraded

    @property
    def missed_nodes(self) -> frozenset[str]:
        return frozenset(self._missed)

    # -- reads ---------------------------------------------------------------------------

    async def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None = None) -> dict[str, int]:
        self._ensure_watch()
        if not self._degraded:
            res = await self._lookup_primary(hashes, nodes)
            if not isinstance(res, _Failed):
                return res
        self.counters.degraded_lookups += 1
        if self.mirror is not None:
            return self.mirror.lookup(hashes, nodes)
        return dict.fromkeys(nodes or (), 0)

    async def node_hashes(self, node: str) -> set[int]:
        if not self._degraded:
            res = await self._read(self.primary.node_hashes(node), "node_hashes")
            if not isinstance(res, _Failed):
                return res
        nb = self.mirror.nodes.get(node) if self.mirror is not None else None
        return set(nb.blocks) if nb is not None else set()

    async def stats(self) -> IndexStats:
        self._ensure_watch()
        health = asdict(self.counters)
        if not self._degraded:
            res = await self._read(self.primary.stats(), "stats")
            if not isinstance(res, _Failed):
                return replace(res, health=health)
        local = self.mirror.stats() if self.mirror is not None else IndexStats(self.backend, 0)
        return replace(local, backend=self.backend, degraded=True, health=health)

    # -- writes: mirror always, primary unless degraded ----------------------------------

    async def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        local = self.mirror.store(ops) if self.mirror is not None else [True] * len(ops)
        res = await self._write(self.primary.store(ops), "store", {op.node for op in ops})
        return local if isinstance(res, _Failed) else res

    async def remove(self, node: str, hashes: Iterable[int]) -> int:
        hashes = list(hashes)
        local = self.mirror.remove(node, hashes) if self.mirror is not None else 0
        res = await self._write(self.primary.remove(node, hashes), "remove", {node})
        return local if isinstance(res, _Failed) else res

    async def clear_node(self, node: str) -> int:
        local = self.mirror.clear_node(node) if self.mirror is not None else 0
        res = await self._write(self.primary.clear_node(node), "clear_node", {node})
        return local if isinstance(res, _Failed) else res

    async def replace_node(self, node: str, chains: Sequence[Sequence[int]]) -> None:
        if self.mirror is not None:
            self.mirror.replace_node(node, chains)
        res = await self._write(self.primary.replace_node(node, chains), "replace_node", {node})
        if not isinstance(res, _Failed):
            self._missed.discard(node)  # Redis now has exactly what the node holds

    async def set_capacity(self, node: str, blocks: int) -> None:
        if self.mirror is not None:
            self.mirror.set_capacity(node, blocks)
        await self._write(self.primary.set_capacity(node, blocks), "set_capacity", {node})

    async def close(self) -> None:
        self._closed = True
        watch, self._watch = self._watch, None
        # cancelled until they end (``stop_task``), should a cancellation ever be lost
        await stop_tasks([*([watch] if watch is not None else []), *self._background])
        try:
            await self.primary.close()
        except Exception as exc:
            log.warning("index.close_failed", error=repr(exc))

    # -- lookups with a deadline that is not a failure -----------------------------------

    async def _lookup_primary(
        self, hashes: Sequence[int], nodes: Sequence[str] | None
    ) -> dict[str, int] | _Failed:
        if self._late_in_flight >= _MAX_LATE_IN_FLIGHT:
            self._note_late()  # Redis is far behind: do not pile more calls on it
            return FAILED
        task = asyncio.ensure_future(self._read(self.primary.lookup(hashes, nodes), "lookup"))
        try:
            done, _ = await asyncio.wait((task,), timeout=self.lookup_timeout)
        except asyncio.CancelledError:  # the request went away: so does its lookup
            task.cancel()
            raise
        if done:
            res = task.result()
            if not isinstance(res, _Failed):
                self._late_since = None
            return res
        # Late: answer from the mirror now; the call runs on and says whether Redis is healthy.
        self._late_in_flight += 1
        self._background.add(task)
        task.add_done_callback(self._late_done)
        self._note_late()
        return FAILED

    def _late_done(self, task: asyncio.Future[Any]) -> None:
        self._late_in_flight -= 1
        self._background.discard(task)

    def _note_late(self) -> None:
        self.counters.late_lookups += 1
        now = self.clock()
        if self._late_since is None:
            self._late_since = now
        elif now - self._late_since >= self.sustained_late_s:
            self._enter_degraded("lookup", f"every lookup late for {now - self._late_since:.1f} s")
            self._degraded_by_lateness = True

    # -- failure accounting --------------------------------------------------------------

    async def _read(self, coro: Coroutine[Any, Any, T], what: str) -> T | _Failed:
        try:
            async with asyncio.timeout(self.call_timeout):
                res = await coro
        except Exception as exc:  # Redis down, slow, or answering garbage: never the caller's problem
            self.counters.failed_calls += 1
            self._read_failures += 1
            if self._read_failures >= self.failures_to_degrade:
                self._enter_degraded(what, _describe(exc))
            return FAILED
        self._read_failures = 0
        return res

    async def _write(self, coro: Coroutine[Any, Any, T], what: str, nodes: set[str]) -> T | _Failed:
        self._ensure_watch()
        if self._degraded:
            coro.close()
            self.counters.dropped_writes += 1
            self._missed |= nodes
            return FAILED
        try:
            async with asyncio.timeout(self.call_timeout):
                res = await coro
        except Exception as exc:  # refused (OOM, read-only replica), down or silent
            self.counters.failed_calls += 1
            self.counters.failed_writes += 1
            self.counters.dropped_writes += 1
            self._missed |= nodes
            self._write_failures += 1
            if self._write_failures == 1 or self._write_failures >= self.failures_to_degrade:
                log.warning("index.write_failed", backend=self.backend, call=what, error=_describe(exc))
            if self._write_failures >= self.failures_to_degrade:
                self._enter_degraded(what, _describe(exc))
            return FAILED
        self._write_failures = 0
        return res

    def _enter_degraded(self, what: str, error: str) -> None:
        if self._degraded or self._closed:
            return
        self._degraded = True
        self._degraded_by_lateness = False
        self.counters.degraded_periods += 1
        log.warning(
            "index.degraded",
            backend=self.backend,
            call=what,
            error=error,
            serving="mirror" if self.mirror is not None else "empty hits",
        )
        self._ensure_watch()

    def _leave_degraded(self) -> None:
        self._degraded = False
        self._degraded_by_lateness = False
        self._read_failures = self._write_failures = 0
        self._late_since = None
        self.counters.recoveries += 1
        log.info(
            "index.recovered",
            backend=self.backend,
            degraded_lookups=self.counters.degraded_lookups,
            dropped_writes=self.counters.dropped_writes,
            missed_nodes=len(self._missed),
        )
        self.recovered.set()

    # -- the watch: probe while degraded, epoch check and pending resyncs otherwise ------

    def _ensure_watch(self) -> None:
        if self._closed or (self._watch is not None and not self._watch.done()):
            return
        with contextlib.suppress(RuntimeError):  # no running loop: the next call starts it
            self._watch = asyncio.get_running_loop().create_task(self._watch_loop(), name="index-watch")

    async def _watch_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.probe_interval if self._degraded else self.check_interval)
            if self._degraded:
                await self._probe()
            else:
                await self._check()

    async def _probe(self) -> None:
        t0 = self.clock()
        try:
            async with asyncio.timeout(self.call_timeout):
                await self.primary.ping()
                lost = await self.primary.check(write=True)
        except Exception:
            return
        if self._degraded_by_lateness and self.clock() - t0 > self.lookup_timeout:
            return  # answering, but still slower than a lookup may be
        self._leave_degraded()
        self._note_lost(lost)
        await self._resync("recovered")

    async def _check(self) -> None:
        lost = await self._read(self.primary.check(), "check")
        if isinstance(lost, _Failed):
            return
        self._note_lost(lost)
        await self._resync("data_lost" if lost else "write_failed")

    def _note_lost(self, lost: set[str]) -> None:
        if not lost:
            return
        self.counters.data_losses += len(lost)
        log.warning("index.data_lost", backend=self.backend, nodes=sorted(lost))
        self._missed |= lost

    async def _resync(self, reason: str) -> None:
        """Hand the nodes Redis missed to ``on_resync`` (they are replaced by fresh snapshots)."""
        if not self._missed or self._degraded:
            return
        nodes = frozenset(self._missed)
        self._missed.clear()
        self.counters.resynced_nodes += len(nodes)
        log.info("index.resync", backend=self.backend, reason=reason, nodes=sorted(nodes))
        if self.on_resync is None:
            return
        try:
            res = self.on_resync(nodes, reason)
            if inspect.isawaitable(res):
                fut = asyncio.ensure_future(res)
                self._background.add(fut)
                fut.add_done_callback(self._background.discard)
        except Exception as exc:
            log.warning("index.on_resync_failed", error=repr(exc))


class MirrorWrites:
    """A ``ResilientIndex`` whose writes reach its mirror only: for a process that sees the same
    writes as a sibling which makes them to the shared index (gateway workers of one supervisor
    on a user's Redis all follow the nodes' KV events; one of them writes them; on their own
    store they use ``cachetier.replicated`` instead). Reads are the index's own."""

    def __init__(self, index: ResilientIndex, mirror: IndexCore) -> None:
        self.index = index
        self.mirror = mirror
        self.backend = index.backend

    async def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None = None) -> dict[str, int]:
        return await self.index.lookup(hashes, nodes)

    async def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        return self.mirror.store(ops)

    async def remove(self, node: str, hashes: Iterable[int]) -> int:
        return self.mirror.remove(node, hashes)

    async def clear_node(self, node: str) -> int:
        return self.mirror.clear_node(node)

    async def replace_node(self, node: str, chains: Sequence[Sequence[int]]) -> None:
        self.mirror.replace_node(node, chains)

    async def set_capacity(self, node: str, blocks: int) -> None:
        self.mirror.set_capacity(node, blocks)

    async def node_hashes(self, node: str) -> set[int]:
        return await self.index.node_hashes(node)

    async def stats(self) -> IndexStats:
        return await self.index.stats()

    async def close(self) -> None:
        """The index is its owner's to close."""


def mirror_writes(index: BlockIndex) -> BlockIndex:
    """``index`` with writes to its local mirror only, or ``index`` itself when it has none (an
    embedded index is no one else's; a shared index without a mirror gets every write)."""
    if isinstance(index, ResilientIndex) and index.mirror is not None:
        return MirrorWrites(index, index.mirror)
    return index


def _describe(exc: BaseException) -> str:
    return "deadline exceeded" if isinstance(exc, TimeoutError) else repr(exc)[:200]
