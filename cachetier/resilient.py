"""Degraded mode: a Redis outage degrades routing, never requests.

``ResilientIndex`` wraps a shared index (Redis) with a lookup deadline and a local mirror (an
``IndexCore`` fed with the same writes). When Redis fails or is slow, lookups are answered from
the mirror; after ``failures_to_degrade`` consecutive failures the wrapper enters degraded mode:
it stops calling Redis on the request path, serves every lookup from the mirror, drops writes
for Redis (they still reach the mirror), and probes Redis every ``probe_interval`` seconds.
When Redis answers again it leaves degraded mode by itself and sets ``recovered`` (and calls
``on_recovered``) so the gateway can resync nodes from their KV events. No method raises
because of Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import structlog

from cachetier.index import DEFAULT_CAPACITY_BLOCKS, BlockIndex, IndexStats, StoreOp
from cachetier.memory import IndexCore

log = structlog.get_logger("prefixgate.cachetier.resilient")

T = TypeVar("T")


class _Failed:
    """Marks a primary call that errored or missed its deadline."""


FAILED = _Failed()


class ProbedIndex(BlockIndex, Protocol):
    """A shared index that can be pinged (``RedisIndex``)."""

    async def ping(self) -> None: ...


@dataclass(slots=True)
class ResilienceStats:
    degraded_lookups: int = 0  # lookups answered from the mirror (or empty)
    failed_calls: int = 0  # calls to the primary that errored or missed their deadline
    dropped_writes: int = 0  # writes the primary never received
    degraded_periods: int = 0
    recoveries: int = 0


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
        on_recovered: Callable[[], Awaitable[None] | None] | None = None,
    ) -> None:
        self.primary = primary
        self.backend = primary.backend
        self.mirror: IndexCore | None = IndexCore(default_capacity) if mirror else None
        self.lookup_timeout = lookup_timeout
        self.call_timeout = call_timeout
        self.probe_interval = probe_interval
        self.failures_to_degrade = max(1, failures_to_degrade)
        self.on_recovered = on_recovered
        self.counters = ResilienceStats()
        self.recovered = asyncio.Event()  # set on each recovery; the gateway clears it after resync
        self._degraded = False
        self._failures = 0
        self._probe: asyncio.Task[None] | None = None
        self._callbacks: set[asyncio.Future[Any]] = set()
        self._closed = False

    @property
    def degraded(self) -> bool:
        return self._degraded

    # -- reads ---------------------------------------------------------------------------

    async def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None = None) -> dict[str, int]:
        if not self._degraded:
            res = await self._call(self.primary.lookup(hashes, nodes), self.lookup_timeout, "lookup")
            if not isinstance(res, _Failed):
                return res
        self.counters.degraded_lookups += 1
        if self.mirror is not None:
            return self.mirror.lookup(hashes, nodes)
        return dict.fromkeys(nodes or (), 0)

    async def node_hashes(self, node: str) -> set[int]:
        if not self._degraded:
            res = await self._call(self.primary.node_hashes(node), self.call_timeout, "node_hashes")
            if not isinstance(res, _Failed):
                return res
        nb = self.mirror.nodes.get(node) if self.mirror is not None else None
        return set(nb.blocks) if nb is not None else set()

    async def stats(self) -> IndexStats:
        if not self._degraded:
            res = await self._call(self.primary.stats(), self.call_timeout, "stats")
            if not isinstance(res, _Failed):
                return res
        local = self.mirror.stats() if self.mirror is not None else IndexStats(self.backend, 0)
        return replace(local, backend=self.backend, degraded=True)

    # -- writes: mirror always, primary unless degraded ----------------------------------

    async def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        local = self.mirror.store(ops) if self.mirror is not None else [True] * len(ops)
        res = await self._write(self.primary.store(ops), "store")
        return local if isinstance(res, _Failed) else res

    async def remove(self, node: str, hashes: Iterable[int]) -> int:
        hashes = list(hashes)
        local = self.mirror.remove(node, hashes) if self.mirror is not None else 0
        res = await self._write(self.primary.remove(node, hashes), "remove")
        return local if isinstance(res, _Failed) else res

    async def clear_node(self, node: str) -> int:
        local = self.mirror.clear_node(node) if self.mirror is not None else 0
        res = await self._write(self.primary.clear_node(node), "clear_node")
        return local if isinstance(res, _Failed) else res

    async def replace_node(self, node: str, chains: Sequence[Sequence[int]]) -> None:
        if self.mirror is not None:
            self.mirror.replace_node(node, chains)
        await self._write(self.primary.replace_node(node, chains), "replace_node")

    async def set_capacity(self, node: str, blocks: int) -> None:
        if self.mirror is not None:
            self.mirror.set_capacity(node, blocks)
        await self._write(self.primary.set_capacity(node, blocks), "set_capacity")

    async def close(self) -> None:
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None
        try:
            await self.primary.close()
        except Exception as exc:
            log.warning("index.close_failed", error=repr(exc))

    # -- failure handling ----------------------------------------------------------------

    async def _write(self, coro: Coroutine[Any, Any, T], what: str) -> T | _Failed:
        if self._degraded:
            coro.close()
            self.counters.dropped_writes += 1
            return FAILED
        res = await self._call(coro, self.call_timeout, what)
        if isinstance(res, _Failed):
            self.counters.dropped_writes += 1
        return res

    async def _call(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T | _Failed:
        try:
            async with asyncio.timeout(timeout):
                res = await coro
        except Exception as exc:  # Redis down, slow, or answering garbage: never the caller's problem
            self.counters.failed_calls += 1
            self._failures += 1
            if self._failures >= self.failures_to_degrade:
                self._enter_degraded(what, exc)
            return FAILED
        self._failures = 0
        return res

    def _enter_degraded(self, what: str, exc: BaseException) -> None:
        if self._degraded or self._closed:
            return
        self._degraded = True
        self.counters.degraded_periods += 1
        log.warning(
            "index.degraded",
            backend=self.backend,
            call=what,
            error=repr(exc) if not isinstance(exc, TimeoutError) else "deadline exceeded",
            serving="mirror" if self.mirror is not None else "empty hits",
        )
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name="index-probe")

    async def _probe_loop(self) -> None:
        while self._degraded and not self._closed:
            await asyncio.sleep(self.probe_interval)
            try:
                async with asyncio.timeout(max(self.call_timeout, self.lookup_timeout)):
                    await self.primary.ping()
            except Exception:
                continue
            self._leave_degraded()
        self._probe = None

    def _leave_degraded(self) -> None:
        self._degraded = False
        self._failures = 0
        self.counters.recoveries += 1
        log.info(
            "index.recovered",
            backend=self.backend,
            degraded_lookups=self.counters.degraded_lookups,
            dropped_writes=self.counters.dropped_writes,
        )
        self.recovered.set()
        if self.on_recovered is not None:
            try:
                res = self.on_recovered()
                if inspect.isawaitable(res):
                    fut = asyncio.ensure_future(res)
                    self._callbacks.add(fut)
                    fut.add_done_callback(self._callbacks.discard)
            except Exception as exc:
                log.warning("index.on_recovered_failed", error=repr(exc))
