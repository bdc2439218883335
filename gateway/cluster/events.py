"""Node KV events -> index: what the nodes really hold, applied to the shared index.

Each node streams STORED/REMOVED events with consecutive sequence numbers. A gap, a new node
instance (restart) or a SNAPSHOT replaces the node's block set in the index; applying the same
event twice is harmless (stores and removals are idempotent), so several gateways can apply them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from prefixgate.cachetier.index import BlockIndex, StoreOp
from prefixgate.cachetier.tasks import stop_tasks
from prefixgate.gateway.cluster.nodes import Node, NodePool
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.nodeclient import KVEvent, NodeFailure
from prefixgate.gateway.vocab import EventKind, FailureKind

log = structlog.get_logger("prefixgate.events")

INDEX_CAPACITY_HEADROOM = 1.25


def index_capacity(pool_blocks: int) -> int:
    """The index's own bound for a node: above the node's pool, so the node's REMOVED events
    (which know about pins and blocks in use) decide what goes, and the index's LRU is only a
    safety net against lost events."""
    return int(pool_blocks * INDEX_CAPACITY_HEADROOM) + 1


def snapshot_chains(event: KVEvent) -> list[list[int]]:
    """Turn a SNAPSHOT (blocks with parents, parents first) into root-first chains."""
    chains: list[list[int]] = []
    path_of: dict[int, list[int]] = {}
    children: set[int] = set(event.parents)
    for h, parent in zip(event.hashes, event.parents, strict=False):
        base = path_of.get(parent, []) if parent else []
        path = [*base, h]
        path_of[h] = path
    for h, path in path_of.items():
        if h not in children:  # a leaf: its chain covers all its ancestors
            chains.append(path)
    return chains


class EventSync:
    """Follows each node's events into ``index``. ``repair_index``: where the snapshot a
    ``resync`` asks for goes when ``index`` is not the shared index itself (a gateway worker
    that leaves the event stream to a sibling, ``cachetier.resilient.MirrorWrites``): a node
    found out of step (mispredicted, lost by Redis) is put right in the shared index by
    whichever worker found it, not only in that worker's mirror."""

    def __init__(
        self,
        pool: NodePool,
        index: BlockIndex,
        metrics: Metrics,
        retry_s: float = 0.5,
        repair_index: BlockIndex | None = None,
    ) -> None:
        self.pool = pool
        self.index = index
        self.repair_index = repair_index
        self.metrics = metrics
        self.retry_s = retry_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.last_seq: dict[str, int] = {}
        self.instance: dict[str, str] = {}
        self._repairing: set[str] = set()  # addresses whose next snapshot goes to ``repair_index``
        self.applied = 0

    def watch(self, node: Node) -> None:
        task = asyncio.create_task(self._follow(node), name=f"kv-events:{node.address}")
        self._tasks[node.address] = task

    def unwatch(self, node: Node) -> None:
        task = self._tasks.pop(node.address, None)
        if task is not None:
            task.cancel()

    def resync(self, node: Node) -> None:
        """Force a fresh snapshot on the next (re)connection (to ``repair_index`` if there is one)."""
        if self.repair_index is not None:
            self._repairing.add(node.address)
        self.last_seq.pop(node.address, None)
        self.unwatch(node)
        self.watch(node)

    def forget(self, node: Node) -> None:
        """Stop following a node and drop what is known of its event stream."""
        self.unwatch(node)
        self.last_seq.pop(node.address, None)
        self.instance.pop(node.address, None)
        self._repairing.discard(node.address)

    async def _follow(self, node: Node) -> None:
        if not node.client.capabilities.kv_events:
            return  # the index learns this node's blocks from routing alone
        quick = True  # a resync reconnects at once, unless the last one made no progress
        while node.client.capabilities.kv_events:  # a node may find out it has none (SMG: UNIMPLEMENTED)
            events = None
            try:
                events = node.client.kv_events(self.last_seq.get(node.address, 0))
                async for ev in events:
                    await self._apply(node, ev)
                    quick = quick or ev.kind != EventKind.SNAPSHOT  # progress past a snapshot
            except asyncio.CancelledError:
                raise
            except _Resync:
                if quick:
                    quick = False
                    continue
            except NodeFailure as e:
                if e.kind not in (FailureKind.UNAVAILABLE, FailureKind.CANCELLED):
                    log.warning("kv_events_error", node=node.id, kind=e.kind.value, detail=e.detail[:200])
            except Exception as e:
                log.warning("kv_events_apply_failed", node=node.id, error=repr(e)[:200])
                self.last_seq.pop(node.address, None)
            finally:
                if events is not None:
                    with contextlib.suppress(Exception):
                        await events.aclose()
            await asyncio.sleep(self.retry_s)

    async def _apply(self, node: Node, ev: KVEvent) -> None:
        if node.status is None or not node.node_id:
            await self.pool.refresh(node)
        node_id = node.id
        prev_instance = self.instance.get(node.address)
        last = self.last_seq.get(node.address)
        if ev.kind == EventKind.SNAPSHOT:
            target = self.index
            if self.repair_index is not None and node.address in self._repairing:
                target = self.repair_index
            if node.status is not None and node.status.capacity_blocks:  # bound first, then fill
                await target.set_capacity(node_id, index_capacity(node.status.capacity_blocks))
            await target.replace_node(node_id, snapshot_chains(ev))
            self._repairing.discard(node.address)
            self.metrics.resyncs.labels("snapshot").inc()
        elif prev_instance != ev.instance_id or last is None or ev.seq != last + 1:
            # Restart or gap: ask for a snapshot by reconnecting from zero.
            self.metrics.resyncs.labels("gap" if prev_instance == ev.instance_id else "restart").inc()
            log.info("kv_events_resync", node=node_id, last=last, seq=ev.seq)
            self.last_seq.pop(node.address, None)
            raise _Resync()
        elif ev.kind == EventKind.STORED:
            ok = await self.index.store([StoreOp(node_id, ev.hashes, ev.parent)])
            if not all(ok):
                self.metrics.resyncs.labels("orphan").inc()
                self.last_seq.pop(node.address, None)
                raise _Resync()
        elif ev.kind == EventKind.REMOVED:
            await self.index.remove(node_id, ev.hashes)
        elif ev.kind == EventKind.CLEARED:
            await self.index.clear_node(node_id)
        self.instance[node.address] = ev.instance_id
        self.last_seq[node.address] = ev.seq
        self.applied += 1
        m = self.metrics
        m.child(m.events_applied, ev.kind.value).inc()

    async def close(self) -> None:
        tasks: list[asyncio.Future[Any]] = list(self._tasks.values())
        self._tasks.clear()
        await stop_tasks(tasks)  # cancelled until they end: one cancellation can be lost


class _Resync(Exception):
    """Reconnect from sequence 0 to get a snapshot."""
