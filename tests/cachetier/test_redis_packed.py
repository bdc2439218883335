"""The ``packed`` layout of the Redis index: key schema, bucket splits, memory, TTL, atomic
batches, and living next to the ``zset`` layout under one prefix (neither reads the other).

Its semantics are the contract suite's (``tests/contract``, ``redis-packed``)."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from prefixgate.cachetier.index import StoreOp
from prefixgate.cachetier.redis_index import RedisIndex
from prefixgate.cachetier.redis_schema import (
    BUCKET_FILL,
    ENTRY_BYTES,
    bucket_of,
    entries,
    pack_hash,
    unpack_hash,
)
from tests.cachetier.support import test_prefix


@pytest.fixture
async def packed(url: str) -> AsyncIterator[RedisIndex]:
    index = RedisIndex.from_url(url, prefix=test_prefix(), layout="packed", default_capacity=100_000)
    try:
        yield index
    finally:
        await index.purge()
        await index.close()


async def test_key_schema_three_keys_per_node_in_one_slot(packed: RedisIndex) -> None:
    await packed.store([StoreOp("p0", (1, 2, 3)), StoreOp("p1", (1,))])
    raw = await packed.client.keys(packed.keys.pattern)
    keys = sorted(k.decode() if isinstance(k, bytes) else k for k in raw)
    v = packed.keys.prefix + "v2:"
    node_keys = [f"{v}{{{n}}}:{k}" for n in ("p0", "p1") for k in ("m", "h", "z")]
    assert keys == sorted([f"{v}nodes", *node_keys])
    # One bucket while small: 8-byte packed hashes, each with its tick, least recent first;
    # a chain is touched root last (the root is the most recent).
    bucket = await packed.client.hget(packed.keys.blocks("p0"), "0")
    assert isinstance(bucket, bytes) and len(bucket) == 3 * ENTRY_BYTES
    assert entries(bucket) == [pack_hash(3), pack_hash(2), pack_hash(1)]


async def test_buckets_split_one_at_a_time_and_hold_their_own_hashes(packed: RedisIndex) -> None:
    """Linear hashing: one large store pre-splits; every bucket holds the hashes it should."""
    rng = random.Random(3)
    chain = tuple(rng.getrandbits(64) for _ in range(5000))
    assert await packed.store([StoreOp("n", chain)]) == [True]
    meta = await packed.client.hgetall(packed.keys.meta("n"))
    level, split = int(meta[b"L"]), int(meta[b"s"])
    assert int(meta[b"n"]) == 5000 and (1 << level) + split >= 5000 // BUCKET_FILL
    raw = await packed.client.hgetall(packed.keys.blocks("n"))
    buckets = {int(k): entries(bytes(v)) for k, v in raw.items()}  # type: ignore[arg-type]
    assert sum(len(b) for b in buckets.values()) == 5000
    assert max(len(b) for b in buckets.values()) <= 3 * BUCKET_FILL
    for i, members in buckets.items():
        assert {bucket_of(unpack_hash(m), level, split) for m in members} == {i}
    assert await packed.lookup((*chain, 7), ["n"]) == {"n": 5000}


async def test_memory_per_block_is_a_fifth_of_the_zset_layout(packed: RedisIndex, url: str) -> None:
    chains = [tuple(range(10_000 * c + 1, 10_000 * c + 1001)) for c in range(5)]
    ops = [StoreOp("big", c) for c in chains]
    zset = RedisIndex.from_url(url, prefix=test_prefix(), default_capacity=100_000)
    try:
        await packed.store(ops)
        await zset.store(ops)
        small, held, _ = await packed.memory_usage("big")
        big, zheld, encoding = await zset.memory_usage("big")
        assert held == zheld == 5000 and encoding == "skiplist"
        assert small / held <= 30 and small * 4 < big  # README: ≈ 18 vs ≈ 104 B/block
    finally:
        await zset.purge()
        await zset.close()


async def test_writes_set_and_refresh_the_ttl(url: str) -> None:
    index = RedisIndex.from_url(url, prefix=test_prefix(), layout="packed", ttl_seconds=120)
    try:
        await index.store([StoreOp("n", (1, 2))])
        for key in (*index.keys.node_keys("n"), index.keys.registry):
            assert 0 < await index.client.ttl(key) <= 120
        await index.client.expire(index.keys.blocks("n"), 5)
        await index.set_capacity("n", 10)
        assert await index.client.ttl(index.keys.blocks("n")) > 5
    finally:
        await index.purge()
        await index.close()


async def test_store_batch_is_atomic(packed: RedisIndex, url: str) -> None:
    """A reader polling while a large multi-node batch lands sees all of it or none of it."""
    chains = {f"n{i}": tuple(range(1000 * i + 1, 1000 * i + 801)) for i in range(4)}
    probe = aioredis.Redis.from_url(url)
    counted: set[tuple[int, ...]] = set()
    filled: set[tuple[bool, ...]] = set()
    done = asyncio.Event()

    async def poll() -> None:
        for _ in range(2000):
            if done.is_set():
                break
            pipe = probe.pipeline(transaction=True)
            for n in chains:
                pipe.hget(packed.keys.meta(n), "n")
                pipe.hlen(packed.keys.blocks(n))
            raw = await pipe.execute()
            counted.add(tuple(int(v or 0) for v in raw[0::2]))
            filled.add(tuple(int(v) > 0 for v in raw[1::2]))

    try:
        poller = asyncio.create_task(poll())
        await asyncio.sleep(0)
        assert await packed.store([StoreOp(n, c) for n, c in chains.items()]) == [True] * 4
        done.set()
        await poller
    finally:
        await probe.aclose()
    assert counted <= {(0, 0, 0, 0), (800, 800, 800, 800)}
    assert filled <= {(False,) * 4, (True,) * 4}
    assert await packed.lookup(chains["n2"]) == {"n0": 0, "n1": 0, "n2": 800, "n3": 0}


async def test_scripts_missing_from_the_server_are_loaded_again(packed: RedisIndex) -> None:
    for name, (text, _) in list(packed._scripts.items()):
        salted = f"{text}\n-- {packed.keys.prefix}\n"
        packed._scripts[name] = (salted, hashlib.sha1(salted.encode()).hexdigest())
    assert await packed.store([StoreOp("a", (5, 6, 7))]) == [True]
    assert await packed.lookup([5, 6, 7, 8], ["a"]) == {"a": 3}
    assert await packed.store([StoreOp("a", (9,), parent=7)]) == [True]
    assert await packed.remove("a", [9]) == 1
    assert await packed.clear_node("a") == 3


async def test_the_other_layout_is_ignored_and_can_be_dropped(url: str) -> None:
    """Switching layouts under one prefix: neither reads the other's keys; each drops them."""
    prefix = test_prefix()
    zset = RedisIndex.from_url(url, prefix=prefix)
    packed = RedisIndex.from_url(url, prefix=prefix, layout="packed")
    try:
        await zset.store([StoreOp("old", (1, 2))])
        await packed.store([StoreOp("new", (1, 2, 3))])
        assert await packed.known_nodes() == ["new"] and await zset.known_nodes() == ["old"]
        assert await packed.lookup([1, 2, 3], ["old", "new"]) == {"old": 0, "new": 3}
        assert await zset.lookup([1, 2, 3], ["old", "new"]) == {"old": 2, "new": 0}
        assert (await packed.stats()).total_blocks == 3
        assert await packed.purge_other_layout() == 3  # {old}:z, {old}:m, nodes
        raw = await packed.client.keys(packed.keys.pattern)
        assert all((k.decode() if isinstance(k, bytes) else k).startswith(prefix + "v2:") for k in raw)
        assert await packed.lookup([1, 2, 3], ["new"]) == {"new": 3}
        assert await zset.purge_other_layout() == 4  # the packed layout's keys
        assert await packed.lookup([1, 2, 3], ["new"]) == {"new": 0}
    finally:
        await packed.purge()
        await zset.close()
        await packed.close()


async def test_a_large_node_evicts_exactly_lru_across_buckets(packed: RedisIndex) -> None:
    """Thousands of blocks in many buckets: eviction order is the global LRU order."""
    rng = random.Random(5)
    chains = [tuple(rng.getrandbits(64) for _ in range(500)) for _ in range(8)]
    for c in chains:
        await packed.store([StoreOp("n", c)])
    await packed.store([StoreOp("n", chains[0][:100])])  # chain 0's head becomes the most recent
    await packed.set_capacity("n", 1000)
    # kept: chain 0's first 100 blocks, chain 7 (500), and chain 6's root side (400 blocks)
    held = await packed.node_hashes("n")
    assert held == set(chains[0][:100]) | set(chains[7]) | set(chains[6][:400])
    assert (await packed.stats()).nodes["n"].blocks == 1000
    assert await packed.lookup(chains[6], ["n"]) == {"n": 400}
