"""Event sync through the node-client seam: the index follows what a (fake) node reports."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from prefixgate.cachetier.index import StoreOp
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.gateway.cluster.events import EventSync
from prefixgate.gateway.cluster.nodes import NodePool
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.nodeclient import KVEvent
from prefixgate.gateway.nodeclient.fake import FakeNodeClient, fake_status
from prefixgate.gateway.vocab import EventKind

pytestmark = pytest.mark.timeout(10)


async def until(cond: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_snapshot_then_stored_then_removed_reach_the_index_and_forget_stops_it() -> None:
    events = [
        KVEvent(0, "i1", EventKind.SNAPSHOT, hashes=(1, 2), parents=(0, 1)),
        KVEvent(1, "i1", EventKind.STORED, parent=2, hashes=(3, 4)),
        KVEvent(2, "i1", EventKind.REMOVED, hashes=(4,)),
    ]
    client = FakeNodeClient("d1", status=fake_status("d1", "decode"), events=events)
    pool = NodePool(connect=lambda a: client, poll=False)
    index = MemoryIndex()
    sync = EventSync(pool, index, Metrics(), retry_s=0.01)
    try:
        node = pool.add("decode", "d1")
        await pool.refresh(node)
        sync.watch(node)
        await until(lambda: sync.last_seq.get("d1") == 2)
        assert await index.lookup([1, 2, 3, 4]) == {"d1": 3}
        assert sync.instance["d1"] == "i1" and sync.applied >= 3
        sync.forget(node)
        assert "d1" not in sync.last_seq and "d1" not in sync.instance
        calls = client.calls.count("kv_events")
        await asyncio.sleep(0.05)
        assert client.calls.count("kv_events") == calls  # no longer followed
    finally:
        await sync.close()
        await pool.close()


async def test_a_gap_in_the_sequence_asks_for_a_fresh_snapshot() -> None:
    events = [
        KVEvent(0, "i1", EventKind.SNAPSHOT, hashes=(1,), parents=(0,)),
        KVEvent(5, "i1", EventKind.STORED, parent=1, hashes=(2,)),  # 1..4 lost
    ]
    client = FakeNodeClient("d1", status=fake_status("d1", "decode"), events=events)
    pool = NodePool(connect=lambda a: client, poll=False)
    metrics = Metrics()
    sync = EventSync(pool, MemoryIndex(), metrics, retry_s=0.01)
    try:
        node = pool.add("decode", "d1")
        await pool.refresh(node)
        sync.watch(node)
        await until(lambda: client.calls.count("kv_events") >= 3)
        gaps = metrics.registry.get_sample_value("prefixgate_index_resyncs_total", {"reason": "gap"})
        assert gaps is not None and gaps >= 2
        assert sync.last_seq.get("d1", 0) == 0  # never past the gap
    finally:
        await sync.close()
        await pool.close()


async def test_a_resync_puts_the_snapshot_in_the_repair_index_and_the_stream_stays_local() -> None:
    """A worker that leaves the event stream to a sibling (its ``index`` its own mirror) still
    repairs the shared index for a node it found out of step: the snapshot a ``resync`` asks for
    goes to ``repair_index``; the events before and after go to ``index`` alone."""
    events = [
        KVEvent(0, "i1", EventKind.SNAPSHOT, hashes=(1, 2), parents=(0, 1)),
        KVEvent(1, "i1", EventKind.STORED, parent=2, hashes=(3,)),
    ]
    client = FakeNodeClient("d1", status=fake_status("d1", "decode"), events=events)
    pool = NodePool(connect=lambda a: client, poll=False)
    local, shared = MemoryIndex(), MemoryIndex()
    await shared.store([StoreOp("d1", (1, 2, 9))])  # 9: what the node does not hold
    sync = EventSync(pool, local, Metrics(), retry_s=0.01, repair_index=shared)
    try:
        node = pool.add("decode", "d1")
        await pool.refresh(node)
        sync.watch(node)
        await until(lambda: sync.last_seq.get("d1") == 1)
        assert await local.lookup([1, 2, 3]) == {"d1": 3}
        assert await shared.node_hashes("d1") == {1, 2, 9}  # the first snapshot is the worker's own
        sync.resync(node)  # found out of step
        for _ in range(200):
            if await shared.node_hashes("d1") == {1, 2}:  # what the node holds, 9 gone
                break
            await asyncio.sleep(0.01)
        assert await shared.node_hashes("d1") == {1, 2}
        await until(lambda: sync.last_seq.get("d1") == 1)
        assert await local.lookup([1, 2, 3]) == {"d1": 3}
        assert 3 not in await shared.node_hashes("d1")  # the stream after it: the sibling's to write
    finally:
        await sync.close()
        await pool.close()
