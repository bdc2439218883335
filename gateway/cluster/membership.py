"""Node membership changes made through the admin API, applied by every replica.

The replica that takes ``POST /admin/nodes``, ``DELETE /admin/nodes/{id}`` or ``POST
/admin/nodes/{id}/drain`` applies it at once and records it in the shared store; every replica
reads the records every ``membership_interval_s`` and brings its own pool in line: a node added
elsewhere is added (and probed, and its KV events followed), one removed elsewhere is removed
(its blocks already left the index with the first removal), drained or undrained likewise. The
last change of an address wins. Nodes given on the command line need no record; a record about
them (drained, removed) overrides the flags, so a replica started later agrees too.

With the embedded store there is one gateway and nothing to follow: no loop runs.

Gateway workers on their supervisor's store do not wait for the beat: the worker that records a
change (or a switch) calls ``announce``, which tells its siblings through the store's pub/sub
(``AdminNudges``), and each of them syncs at once (``wake``); a nudge lost (pub/sub is at most
once) leaves the beat to bring the change, as before. Syncs are at least ``MIN_SYNC_GAP_S``
apart, so a burst of admin calls costs the store a bounded number of reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import structlog

from prefixgate.cachetier.tasks import stop_task
from prefixgate.gateway.cluster.workers import WorkerOptions
from prefixgate.gateway.state.store import Member, StateStore

if TYPE_CHECKING:
    from prefixgate.cachetier.replicated import WorkerSlot
    from prefixgate.gateway.cluster.nodes import Node, NodePool

log = structlog.get_logger("prefixgate.membership")

#: The least time between two syncs however many nudges arrive.
MIN_SYNC_GAP_S = 0.01


class Membership:
    def __init__(
        self,
        state: StateStore,
        pool: NodePool,
        add: Callable[[str, str, WorkerOptions | None], Awaitable[Node]],
        forget: Callable[[Node], Awaitable[None]],
        interval_s: float = 1.0,
        options: Callable[[str], WorkerOptions | None] | None = None,
        also: Sequence[Callable[[], Awaitable[object]]] = (),
    ) -> None:
        """``options(address)``: the options a worker was registered with (None: none); ``also``:
        other admin changes every replica follows on the same beat (the runtime switches)."""
        self.also = tuple(also)
        self.state = state
        self.pool = pool
        self._options = options or (lambda _address: None)
        self._add = add
        self._forget = forget
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.applied = 0  # changes made elsewhere and applied here
        #: Called after a change is recorded: tells the sibling workers to sync now (no-op but
        #: for gateway workers, whose service sets it to ``AdminNudges.announce``).
        self.announce: Callable[[], None] = lambda: None

    def wake(self) -> None:
        """Sync now rather than at the next beat (a sibling worker recorded a change)."""
        self._wake.set()

    @property
    def shared(self) -> bool:
        return self.state.backend != "memory"

    async def record(self, node: Node, *, present: bool) -> None:
        """Record what an admin call did to ``node`` here, for the other replicas."""
        if not self.shared:
            return
        extra = self._options(node.address) if present else None
        record = extra.to_record() if extra is not None else {}
        member = Member(node.address, node.role, present, node.draining and present, time.time(), record)
        try:
            await self.state.member_put(member)
        except Exception as e:  # the change holds here; the others learn it when Redis is back
            log.warning("membership_record_failed", address=node.address, error=repr(e)[:200])
            return
        self.announce()

    async def sync(self) -> int:
        """Bring the pool in line with the records; returns how many changes were applied."""
        changed = 0
        for m in await self.state.members():
            node = self.pool.nodes.get(m.address)
            if m.present and node is None:
                try:
                    extra = WorkerOptions.from_record(dict(m.options)) if m.options else None
                    node = await self._add(m.role, m.address, extra)
                except ValueError as e:
                    log.warning("membership_add_refused", address=m.address, error=str(e))
                    continue
                node.draining = m.draining
                changed += 1
            elif not m.present and node is not None:
                await self._forget(node)
                changed += 1
            elif node is not None and node.draining != m.draining:
                node.draining = m.draining
                changed += 1
        if changed:
            self.applied += changed
            log.info("membership_synced", changes=changed)
        return changed

    async def _loop(self) -> None:
        failing = False  # said once per outage, not once per interval
        while True:
            self._wake.clear()  # a nudge from here on brings another sync
            try:
                await self.sync()
                for follow in self.also:
                    await follow()
                if failing:
                    failing = False
                    log.info("membership_sync_recovered")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: the pool stays as it is until it is back
                if not failing:
                    failing = True
                    log.warning("membership_sync_failed", error=repr(e)[:200])
            await asyncio.sleep(MIN_SYNC_GAP_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self.interval_s - MIN_SYNC_GAP_S)):
                    await self._wake.wait()

    def start(self) -> None:
        if self.shared and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="membership")

    async def close(self) -> None:
        """Stop the loop: cancelled until it ends (``stop_task``), should a cancellation be lost
        (the Redis clients no longer lose one: ``cachetier.redis_clients``)."""
        task, self._task = self._task, None
        await stop_task(task)


class AdminNudges:
    """Tells the sibling gateway workers that an admin change was recorded, and wakes this
    worker's ``Membership`` when one of them does: one short message on the store's pub/sub
    (``cachetier.replicated.sibling_peers``: each worker listening on a channel of its own), never
    awaited. Only the fact travels; the change itself is read from the store by the sync."""

    def __init__(self, url: str, prefix: str, slot: WorkerSlot, membership: Membership) -> None:
        from prefixgate.cachetier.replicated import sibling_peers

        def woken(_message: bytes) -> None:
            membership.wake()

        name = f"admin-{slot.index}"
        self.peers = sibling_peers(url, prefix, slot, woken, suffix=CHANNEL_SUFFIX, name=name)

    def announce(self) -> None:
        self.peers.publish([b"changed"])

    def start(self) -> None:
        self.peers.start()

    async def close(self) -> None:
        await self.peers.close()


#: The pub/sub channels under the key prefix: ``PREFIX admin-changes:N`` is worker N's.
CHANNEL_SUFFIX = "admin-changes"
