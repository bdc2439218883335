"""Redis-specific behaviour of the index: key schema, atomic batches, TTL, one-round-trip lookups."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import redis.asyncio as aioredis

from prefixgate.cachetier.index import StoreOp
from prefixgate.cachetier.redis_index import RedisIndex
from prefixgate.cachetier.redis_schema import KeySchema, pack_hash, pack_hashes
from tests.cachetier.support import test_prefix


async def test_key_schema_puts_each_node_in_one_hash_slot(rindex: RedisIndex) -> None:
    await rindex.store([StoreOp("p0", (1, 2, 3)), StoreOp("p1", (1,))])
    raw = await rindex.client.keys(rindex.keys.pattern)
    keys = sorted(k.decode() if isinstance(k, bytes) else k for k in raw)
    p = rindex.keys.prefix
    assert keys == sorted([f"{p}nodes", f"{p}{{p0}}:z", f"{p}{{p0}}:m", f"{p}{{p1}}:z", f"{p}{{p1}}:m"])
    assert await rindex.client.zscore(rindex.keys.blocks("p0"), pack_hash(3)) is not None
    # Members are 8-byte packed hashes; chains are stored root last (highest score).
    members = await rindex.client.zrange(rindex.keys.blocks("p0"), 0, -1)
    assert members == [pack_hash(3), pack_hash(2), pack_hash(1)]


def test_prefix_must_not_break_the_hash_tag() -> None:
    with pytest.raises(ValueError):
        KeySchema("bad{prefix}:")
    assert KeySchema("a*b:").pattern == "a\\*b:*"


async def test_writes_set_and_refresh_the_ttl(url: str) -> None:
    index = RedisIndex.from_url(url, prefix=test_prefix(), ttl_seconds=120)
    try:
        await index.store([StoreOp("n", (1, 2))])
        for key in (index.keys.blocks("n"), index.keys.meta("n"), index.keys.registry):
            assert 0 < await index.client.ttl(key) <= 120
        await index.client.expire(index.keys.blocks("n"), 5)
        await index.set_capacity("n", 10)
        assert await index.client.ttl(index.keys.blocks("n")) > 5
    finally:
        await index.purge()
        await index.close()


async def test_store_batch_is_atomic(rindex: RedisIndex, url: str) -> None:
    """A reader polling while a large multi-node batch lands sees all of it or none of it."""
    chains = {f"n{i}": tuple(range(1000 * i + 1, 1000 * i + 801)) for i in range(4)}
    ops = [StoreOp(n, c) for n, c in chains.items()]
    probe = aioredis.Redis.from_url(url)
    seen: set[tuple[int, ...]] = set()
    done = asyncio.Event()

    async def poll() -> None:
        for _ in range(2000):
            if done.is_set():
                break
            pipe = probe.pipeline(transaction=True)
            for n in chains:
                pipe.zcard(rindex.keys.blocks(n))
            seen.add(tuple(await pipe.execute()))

    try:
        poller = asyncio.create_task(poll())
        await asyncio.sleep(0)
        assert await rindex.store(ops) == [True] * 4
        done.set()
        await poller
    finally:
        await probe.aclose()
    assert seen <= {(0, 0, 0, 0), (800, 800, 800, 800)}
    assert await rindex.lookup(chains["n2"]) == {"n0": 0, "n1": 0, "n2": 800, "n3": 0}


async def test_lookup_of_a_long_prompt(rindex: RedisIndex) -> None:
    """8,192 blocks, nodes named or all known, unknown nodes count 0 (one EVALSHA per lookup)."""
    prompt = list(range(1, 8193))
    await rindex.store([StoreOp("a", tuple(prompt[:5000])), StoreOp("b", tuple(prompt[:17]))])
    await rindex.set_capacity("c", 100)
    assert await rindex.lookup(prompt, ["a", "b", "c", "ghost"]) == {"a": 5000, "b": 17, "c": 0, "ghost": 0}
    assert await rindex.lookup(prompt) == {"a": 5000, "b": 17, "c": 0}
    assert await rindex.lookup([], ["a"]) == {"a": 0}
    assert await rindex.lookup([10**9, *prompt]) == {"a": 0, "b": 0, "c": 0}


async def test_scripts_missing_from_the_server_are_loaded_again(rindex: RedisIndex) -> None:
    """After a Redis restart its script cache is empty; the index loads its scripts by itself.

    Simulated without flushing the shared Redis: scripts salted with this test's prefix are
    certainly unknown to the server.
    """
    for name, (text, _) in list(rindex._scripts.items()):
        salted = f"{text}\n-- {rindex.keys.prefix}\n"
        rindex._scripts[name] = (salted, hashlib.sha1(salted.encode()).hexdigest())
    assert await rindex.store([StoreOp("a", (5, 6, 7))]) == [True]
    assert await rindex.lookup([5, 6, 7, 8], ["a"]) == {"a": 3}
    assert await rindex.store([StoreOp("a", (9,), parent=7)]) == [True]
    assert await rindex.lookup([5, 6, 7, 9], ["a"]) == {"a": 4}


async def test_memory_per_block_is_small(rindex: RedisIndex) -> None:
    chains = [tuple(range(10_000 * c + 1, 10_000 * c + 1001)) for c in range(5)]
    await rindex.store([StoreOp("big", c) for c in chains] + [StoreOp("small", chains[0][:100])])
    big = await rindex.client.memory_usage(rindex.keys.blocks("big"), samples=0)
    small = await rindex.client.memory_usage(rindex.keys.blocks("small"), samples=0)
    assert big is not None and small is not None
    assert big / 5000 <= 120  # skiplist encoding (see README for the measured figure)
    assert small / 100 <= 30  # listpack encoding for small sets


async def test_purge_deletes_only_its_own_prefix(url: str) -> None:
    a = RedisIndex.from_url(url, prefix=test_prefix())
    b = RedisIndex.from_url(url, prefix=test_prefix())
    try:
        await a.store([StoreOp("n", (1,))])
        await b.store([StoreOp("n", (1,))])
        assert await a.purge() == 3
        assert await b.lookup([1]) == {"n": 1}
    finally:
        await b.purge()
        await a.close()
        await b.close()


def test_pack_hashes_is_little_endian() -> None:
    assert pack_hashes([1, 2**64 - 1]) == pack_hash(1) + b"\xff" * 8


async def test_replicas_sharing_a_prefix_route_as_one(url: str) -> None:
    prefix = test_prefix()
    a = RedisIndex.from_url(url, prefix=prefix, nodes_refresh=0.0)
    b = RedisIndex.from_url(url, prefix=prefix, nodes_refresh=0.0)
    try:
        assert await a.store([StoreOp("p0", (1, 2, 3))]) == [True]
        assert await b.lookup([1, 2, 3, 4]) == {"p0": 3}
        assert await b.store([StoreOp("p0", (4,), parent=3), StoreOp("p1", (1,))]) == [True, True]
        assert await a.lookup([1, 2, 3, 4]) == {"p0": 4, "p1": 1}
        await b.set_capacity("p0", 2)
        assert await a.lookup([1, 2, 3, 4], ["p0"]) == {"p0": 2}
        assert (await a.stats()).nodes["p0"].capacity == 2
    finally:
        await a.purge()
        await a.close()
        await b.close()
