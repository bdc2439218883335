"""What every ``StateStore`` must do, run against each implementation (memory, single Redis,
Redis Cluster): documents, pins, membership and usage, tenant by tenant."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefixgate.gateway.core.errors import InvalidRequest, NotFound, QuotaExceeded
from prefixgate.gateway.state.documents import DocumentLimits
from prefixgate.gateway.state.quotas import PinLimits
from prefixgate.gateway.state.replicated import DocumentRegistry, PinRegistry
from prefixgate.gateway.state.store import Member, StateStore, UsageCounts

DOCS = DocumentLimits(per_tenant_count=3, per_tenant_bytes=20_000, total_bytes=30_000)
PINS = PinLimits(blocks_per_node=4, node_share=0.5, blocks=6, max_seconds=60)


async def documents_are_per_tenant_and_bounded(state: StateStore) -> None:
    reg = DocumentRegistry(state, DOCS)
    a = await reg.put("tenant-a", "alpha text", "manual")
    assert a == "manual"
    assert (await reg.get("tenant-a", "manual")).text == "alpha text"
    with pytest.raises(NotFound):
        await reg.get("tenant-b", "manual")  # invisible to another tenant
    await reg.put("tenant-b", "beta text", "manual")
    assert (await reg.get("tenant-a", "manual")).text == "alpha text"
    assert (await reg.get("tenant-b", "manual")).text == "beta text"
    generated = await reg.put("tenant-a", "second")
    assert generated.startswith("doc-")
    await reg.put("tenant-a", "replaced", "manual")  # a replacement is not a new document
    docs = await reg.get_many("tenant-a", ["manual", generated, "manual"])
    assert [d.text for d in docs] == ["replaced", "second", "replaced"]
    await reg.put("tenant-a", "third", "c")
    with pytest.raises(QuotaExceeded) as e:
        await reg.put("tenant-a", "fourth", "d")
    assert e.value.code == "document_quota_exceeded"
    with pytest.raises(QuotaExceeded) as e:  # the gateway-wide cap, whoever fills it
        await reg.put("tenant-c", "x" * 15_000, "big")
        await reg.put("tenant-d", "y" * 15_000, "big")
    assert e.value.code == "document_store_full"
    usage = await reg.usage("tenant-a")
    assert usage.documents == 3 and usage.bytes > 0
    assert await reg.delete("tenant-b", generated) is False  # not B's
    for doc_id in ("manual", generated, "c"):
        assert await reg.delete("tenant-a", doc_id) is True
    assert await reg.usage("tenant-a") == type(usage)(0, 0)
    assert (await reg.get("tenant-b", "manual")).text == "beta text"
    assert await reg.delete("tenant-c", "big") is True  # its bytes are given back to the store
    await reg.put("tenant-d", "y" * 15_000, "big")


async def pins_hold_quota_and_expire(state: StateStore) -> None:
    pins = PinRegistry(state, PINS)
    caps = {"node-1": 100, "node-2": 0}
    hold = await pins.reserve("tenant-a", caps, [1, 2, 3], 60)
    assert hold.until > time.time()
    rows = {(r.tenant, r.node): r.blocks for r in await pins.rows()}
    assert rows == {("tenant-a", "node-1"): 3, ("tenant-a", "node-2"): 3}
    await pins.reserve("tenant-a", {"node-1": 100}, [1, 2, 3], 30)  # re-pinned: counted once
    with pytest.raises(QuotaExceeded) as e:  # 3 + 2 new > 4 on one node
        await pins.reserve("tenant-a", {"node-1": 100}, [4, 5], 30)
    assert e.value.code == "pin_quota_exceeded" and e.value.retry_after is not None
    await pins.reserve("tenant-b", {"node-1": 100}, [1, 2, 3, 4], 30)  # another tenant's quota is its own
    with pytest.raises(QuotaExceeded):  # 3 + 3 + 1 over all nodes > 6
        await pins.reserve("tenant-a", {"node-3": 100}, [9], 30)
    await pins.cancel(hold, "node-2")  # that pin failed there: given back
    assert {(r.tenant, r.node): r.blocks for r in await pins.rows("tenant-a")} == {("tenant-a", "node-1"): 3}
    with pytest.raises(InvalidRequest):
        await pins.reserve("tenant-a", caps, [1], 61)
    short = await pins.reserve("tenant-c", {"node-1": 100}, [7], 1.0)
    assert short.until - time.time() < 2
    assert [r.tenant for r in await pins.rows("tenant-c")] == ["tenant-c"]
    await asyncio.sleep(1.2)
    assert await pins.rows("tenant-c") == []  # expired
    await pins.reserve("tenant-c", {"node-1": 100}, [10, 11, 12, 13], 30)  # its quota is back


async def membership_last_change_wins(state: StateStore) -> None:
    await state.member_put(Member("127.0.0.1:1", "decode", True, False, 1.0))
    await state.member_put(Member("127.0.0.1:2", "prefill", True, True, 2.0))
    await state.member_put(Member("127.0.0.1:1", "decode", False, False, 3.0))
    got = {m.address: m for m in await state.members()}
    assert got["127.0.0.1:1"].present is False
    assert got["127.0.0.1:2"] == Member("127.0.0.1:2", "prefill", True, True, 2.0)


async def switches_read_back_the_last_change(state: StateStore) -> None:
    assert await state.switches_get() is None  # none made: the settings' switches stand
    await state.switches_put({"disaggregation": False, "prefix_routing": True}, 10.0)
    await state.switches_put({"disaggregation": True, "prefix_routing": False}, 11.5)
    assert await state.switches_get() == ({"disaggregation": True, "prefix_routing": False}, 11.5)


async def usage_sums_per_tenant(state: StateStore) -> None:
    await state.usage_add(
        {("tenant-a", "m"): UsageCounts(1, 100, 40, 5), ("tenant-b", "m"): UsageCounts(1, 7, 0, 1)}
    )
    await state.usage_add(
        {("tenant-a", "m"): UsageCounts(2, 50, 50, 3), ("tenant-a", "m|2"): UsageCounts(1, 1, 0, 0)}
    )
    a = await state.usage("tenant-a")
    assert a == {("tenant-a", "m"): UsageCounts(3, 150, 90, 8), ("tenant-a", "m|2"): UsageCounts(1, 1, 0, 0)}
    assert set(await state.usage(None)) == {("tenant-a", "m"), ("tenant-a", "m|2"), ("tenant-b", "m")}
    assert await state.usage("tenant-z") == {}


CONTRACT = (
    documents_are_per_tenant_and_bounded,
    pins_hold_quota_and_expire,
    membership_last_change_wins,
    switches_read_back_the_last_change,
    usage_sums_per_tenant,
)
