"""The rate limits' counters in the embedded store and on Redis (single, and a Cluster's slots):
the pure limiter's cases, each store agreeing with it."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence

import pytest
from redis.crc import key_slot

from prefixgate.gateway.scheduling.token_limits import Check, Outcome
from prefixgate.gateway.state.memory import MemoryState
from prefixgate.gateway.state.redis_store import RedisState
from prefixgate.gateway.state.store import StateStore
from tests.cachetier.support import RedisClusterHarness, redis_url, test_prefix
from tests.limits.cases import CASES, Counters


class StoreCounters:
    """A store's counters of one tenant, as the cases take them."""

    def __init__(self, store: StateStore, tenant: str) -> None:
        self.store = store
        self.tenant = tenant

    async def reserve(self, checks: Sequence[Check], now_ms: int) -> Outcome:
        return await self.store.limit_reserve(self.tenant, checks, now_ms)

    async def settle(self, deltas: Sequence[tuple[str, int]], bucket: int, now_ms: int) -> None:
        await self.store.limit_settle(self.tenant, deltas, bucket, now_ms)

    async def used(self, counters: Sequence[str], now_ms: int) -> list[int]:
        return await self.store.limit_used(self.tenant, counters, now_ms)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterHarness | None]:
    if shutil.which("redis-server") is None:
        yield None
        return
    harness = RedisClusterHarness().start()
    try:
        yield harness
    finally:
        harness.stop()


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        yield MemoryState()
        return
    if request.param == "cluster":
        harness = request.getfixturevalue("cluster")
        if harness is None:
            pytest.skip("needs redis-server for a private Cluster")
        url = harness.url
    else:
        url = redis_url()
    state = RedisState(url, prefix=test_prefix())
    try:
        yield state
    finally:
        await state.purge()
        await state.close()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
async def test_store_agrees_with_the_pure_limiter(
    store: StateStore, case: Callable[[Counters], Awaitable[None]]
) -> None:
    await case(StoreCounters(store, "tenant-a"))
    await case(StoreCounters(store, "tenant {b}"))  # a brace in the name breaks no hash tag


def test_a_requests_counters_share_one_slot_and_tenants_spread() -> None:
    state = RedisState("redis://127.0.0.1:1", prefix="p:")
    for tenant in ("acme", "t}x{y", ""):
        keys = [state.limit_key(tenant, c) for c in ("tpm", "rpm", "k:0123456789abcdef:tpm", "k:0123:rpm")]
        assert len({key_slot(k.encode()) for k in keys}) == 1
    slots = {key_slot(state.limit_key(f"tenant-{i}", "tpm").encode()) for i in range(50)}
    assert len(slots) > 40


async def test_idle_counters_expire_on_redis() -> None:
    state = RedisState(redis_url(), prefix=test_prefix())
    try:
        await state.limit_reserve("t", [Check("tpm", 10, 1)], 1_000_000_000_000)
        client = await state.client()
        assert 0 < await client.pttl(state.limit_key("t", "tpm")) <= 65_000
    finally:
        await state.purge()
        await state.close()
