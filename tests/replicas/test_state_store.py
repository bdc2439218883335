"""The shared-state store's semantics in memory and on a single Redis (the Cluster runs the same
contract in ``test_replicas.py``), and the Redis-only expiry of documents."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry

from prefixgate.gateway.core.errors import NotFound, Unavailable
from prefixgate.gateway.core.usage import Prices, UsageLedger, Value
from prefixgate.gateway.state.documents import DocumentLimits
from prefixgate.gateway.state.memory import MemoryState
from prefixgate.gateway.state.redis_store import RedisState
from prefixgate.gateway.state.replicated import DocumentRegistry
from prefixgate.gateway.state.store import StateStore, UsageCounts
from tests.cachetier.support import redis_url, test_prefix
from tests.replicas.store_contract import CONTRACT


@pytest.fixture(params=["memory", "redis"])
async def state(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        yield MemoryState()
        return
    store = RedisState(redis_url(), prefix=test_prefix())
    try:
        yield store
    finally:
        await store.purge()
        await store.close()


@pytest.mark.parametrize("check", CONTRACT, ids=lambda c: c.__name__)
async def test_store_contract(state: StateStore, check: Callable[[StateStore], Awaitable[None]]) -> None:
    await check(state)


async def test_a_tenants_documents_expire_on_redis_and_give_their_bytes_back() -> None:
    store = RedisState(redis_url(), prefix=test_prefix(), document_ttl_s=1.0)
    limits = DocumentLimits(per_tenant_count=10, per_tenant_bytes=10**6, total_bytes=10**7)
    reg = DocumentRegistry(store, limits)
    try:
        await reg.put("tenant-a", "kept alive by use", "used")
        await reg.put("tenant-b", "left alone", "idle")
        for _ in range(4):  # a use keeps the tenant's documents alive
            await asyncio.sleep(0.35)
            assert (await reg.get("tenant-a", "used")).text == "kept alive by use"
        with pytest.raises(NotFound):
            await reg.get("tenant-b", "idle")  # 1.4 s without use: gone
        await reg.put("tenant-a", "another", "other")  # the next put forgets tenant-b's bytes
        client = await store.client()
        total = await client.get(store.docs("total"))
        assert total is not None and int(total) == (await reg.usage("tenant-a")).bytes
        assert await client.exists(store.docs("d:tenant-b")) == 0
        assert 0 < await client.pttl(store.docs("d:tenant-a")) <= 1_000 + 60_000
    finally:
        await store.purge()
        await store.close()


async def test_usage_ledgers_of_two_replicas_sum_in_the_store() -> None:
    store = RedisState(redis_url(), prefix=test_prefix())
    prices = Prices(input_miss=8.0, input_hit=2.0, output=16.0)
    one = UsageLedger(store, prices, CollectorRegistry(), flush_s=0.05)
    two = UsageLedger(store, prices, CollectorRegistry(), flush_s=0.05)
    try:
        one.record("tenant-a", "m", prompt=1_000_000, cached=250_000, output=10)
        two.record("tenant-a", "m", prompt=1_000_000, cached=750_000, output=0)
        two.record("tenant-b", "m", prompt=5, cached=0, output=1)
        await one.flush()
        report = await two.report("tenant-a")  # flushes its own first
        (row,) = report.rows
        assert (
            row.counts == UsageCounts(2, 2_000_000, 1_000_000, 10) and row.counts.computed_tokens == 1_000_000
        )
        assert row.value == Value(input_miss=8.0, input_hit=2.0, output=0.00016, total=10.00016)
        assert {r.tenant for r in (await one.report()).rows} == {"tenant-a", "tenant-b"}
        assert await store.usage("tenant-b") == {("tenant-b", "m"): UsageCounts(1, 5, 0, 1)}
    finally:
        await one.close()
        await two.close()
        await store.purge()
        await store.close()


async def test_usage_kept_while_the_store_is_away_and_added_once_it_is_back() -> None:
    store = RedisState("redis://127.0.0.1:1/0", prefix=test_prefix(), max_connections=2)
    ledger = UsageLedger(store, Prices(), CollectorRegistry())
    ledger.record("t", "m", prompt=10, cached=4, output=2)
    with pytest.raises(Unavailable):
        await ledger.flush()
    ledger.record("t", "m", prompt=10, cached=6, output=2)
    assert ledger.flush_failures == 1 and ledger._pending == {("t", "m"): UsageCounts(2, 20, 10, 4)}
    good = RedisState(redis_url(), prefix=test_prefix())
    ledger.state = good
    try:
        await ledger.flush()
        assert await good.usage("t") == {("t", "m"): UsageCounts(2, 20, 10, 4)}
    finally:
        await good.purge()
        await good.close()
        await store.close()


async def test_an_unreachable_store_is_unavailable_not_a_crash() -> None:
    store = RedisState("redis://127.0.0.1:1/0", prefix=test_prefix(), max_connections=2, timeout=0.5)
    reg = DocumentRegistry(store, DocumentLimits())
    try:
        for call in (reg.put("t", "text"), reg.get("t", "doc"), reg.usage("t"), store.members()):
            with pytest.raises(Unavailable) as e:
                await call
            assert e.value.retry_after == 2
    finally:
        await store.close()
