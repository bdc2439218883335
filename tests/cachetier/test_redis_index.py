"""Redis-specific behaviour of the index: key schema, atomic batches, TTL, one-round-trip lookups."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import redis.asyncio as aioredis

from cachetier.index import StoreOp
from cachetier.redis_index import RedisIndex
from cachetier.redis_schema import KeySchema, bucket_count, bucket_of, pack_hash, pack_hashes
from tests.cachetier.support import test_prefix


async def test_key_schema_puts_each_node_in_one_hash_slot(rindex: RedisIndex) -> None:
    await rindex.store([StoreOp("p0", (1, 2, 3)), StoreOp("p1", (1,))])
    raw = await rindex.client.keys(rindex.keys.pattern)
    keys = sorted(k.decode() if isinstance(k, bytes) else k for k in raw)
    p = rindex.keys.prefix
    nb = bucket_count(100_000)
    buckets = [rindex.keys.bucket("p0", bucket_of(h, nb)) for h in (1, 2, 3)] + [rindex.keys.bucket("p1", 1)]
    expected = [f"{p}nodes", f"{p}{{p0}}:m", f"{p}{{p0}}:b", f"{p}{{p1}}:m", f"{p}{{p1}}:b", *buckets]
    assert keys == sorted(expected)
    assert await meta_int(rindex, "p0", "n") == nb == 2048
    # Members are 8-byte packed hashes in their bucket; chains are stored root last (highest score).
    scores = [
        await rindex.client.zscore(rindex.keys.bucket("p0", bucket_of(h, nb)), pack_hash(h))
        for h in (3, 2, 1)
    ]
    assert None not in scores and scores == sorted(s for s in scores if s is not None)
    # The minima ZSET lists the non-empty buckets under their lowest score.
    minima = await rindex.client.zrange(rindex.keys.minima("p0"), 0, -1, withscores=True)
    assert minima == [(str(bucket_of(h, nb)).encode(), s) for h, s in zip((3, 2, 1), scores, strict=True)]


async def test_buckets_stay_listpack_encoded_and_evict_globally_lru(rindex: RedisIndex) -> None:
    """A full node spreads over listpack buckets; eviction still takes the node's least recent."""
    await rindex.set_capacity("a", 4096)
    old = tuple(range(1, 2049))
    new = tuple(range(10_001, 14_097))
    assert await rindex.store([StoreOp("a", old), StoreOp("a", new[:2048])]) == [True, True]
    assert await rindex.lookup(old, ["a"]) == {"a": 2048}
    await rindex.store([StoreOp("a", new)])  # 2,048 new blocks: the old chain goes, leaves first
    assert await rindex.lookup(old, ["a"]) == {"a": 0}
    assert await rindex.lookup(new, ["a"]) == {"a": 4096}
    assert await rindex.node_hashes("a") == set(new)
    nb = await meta_int(rindex, "a", "n")
    assert nb == bucket_count(4096) == 64
    for b in range(nb):
        assert await rindex.client.object("encoding", rindex.keys.bucket("a", b)) == b"listpack"
    assert await rindex.client.zcard(rindex.keys.minima("a")) == nb
    # Shrinking the capacity evicts the overflow (least recent first) and re-buckets the rest.
    await rindex.set_capacity("a", 100)
    assert await rindex.lookup(new, ["a"]) == {"a": 100}
    assert await meta_int(rindex, "a", "n") == bucket_count(100) == 2
    assert (await rindex.stats()).nodes["a"].blocks == 100
    assert await rindex.clear_node("a") == 100
    keys = await rindex.client.keys(rindex.keys.node_pattern("a"))
    assert keys == [rindex.keys.meta("a").encode()]


async def meta_int(index: RedisIndex, node: str, field: str) -> int:
    raw = await index.client.hget(index.keys.meta(node), field)
    assert isinstance(raw, bytes)
    return int(raw)


def test_prefix_must_not_break_the_hash_tag() -> None:
    with pytest.raises(ValueError):
        KeySchema("bad{prefix}:")
    assert KeySchema("a*b:").pattern == "a\\*b:*"


async def test_writes_set_and_refresh_the_ttl(url: str) -> None:
    """Every key of a node gets the TTL; the meta hash never outlives a bucket."""
    index = RedisIndex.from_url(url, prefix=test_prefix(), ttl_seconds=120, default_capacity=256)
    try:
        await index.store([StoreOp("n", (1, 2))])
        keys = [
            index.keys.meta("n"),
            index.keys.minima("n"),
            index.keys.bucket("n", 1),
            index.keys.bucket("n", 2),
        ]
        for key in (*keys, index.keys.registry):
            assert 0 < await index.client.ttl(key) <= 120
        # Buckets a write does not touch are refreshed with the meta, at most every ttl/8.
        await index.client.expire(index.keys.bucket("n", 1), 5)
        await index.client.expire(index.keys.meta("n"), 5)
        await index.store([StoreOp("n", (2,))])
        assert await index.client.ttl(index.keys.bucket("n", 1)) <= 5
        await index.client.hset(index.keys.meta("n"), "e", 0)  # last full refresh long ago
        await index.store([StoreOp("n", (2,))])
        for key in keys:
            assert await index.client.ttl(key) > 5
        await index.client.expire(index.keys.bucket("n", 2), 5)
        await index.set_capacity("n", 200)  # same bucket count; always refreshes everything
        assert await index.client.ttl(index.keys.bucket("n", 2)) > 5
    finally:
        await index.purge()
        await index.close()


async def test_an_expired_node_is_empty_and_its_leftovers_go(rindex: RedisIndex) -> None:
    """Once the meta hash is gone (expired first), the node reads as empty; the next write
    deletes the buckets left behind instead of reviving them."""
    await rindex.store([StoreOp("n", (1, 2, 3))])
    await rindex.client.delete(rindex.keys.meta("n"))
    assert await rindex.lookup([1, 2, 3], ["n"]) == {"n": 0}
    assert await rindex.node_hashes("n") == set()
    assert await rindex.store([StoreOp("n", (7,))]) == [True]
    assert await rindex.node_hashes("n") == {7}
    assert await rindex.lookup([1, 2, 3], ["n"]) == {"n": 0}
    assert (await rindex.stats()).nodes["n"].blocks == 1


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
                pipe.hget(rindex.keys.meta(n), "k")
            seen.add(tuple(int(k or 0) for k in await pipe.execute()))

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
    await rindex.set_capacity("big", 10_000)
    await rindex.store([StoreOp("big", c) for c in chains])
    usage = 0
    for key in await rindex.client.keys(rindex.keys.node_pattern("big")):
        usage += int(await rindex.client.memory_usage(key, samples=0) or 0)
    assert usage / 5000 <= 40  # listpack buckets (see README for the measured figure)


async def test_purge_deletes_only_its_own_prefix(url: str) -> None:
    a = RedisIndex.from_url(url, prefix=test_prefix())
    b = RedisIndex.from_url(url, prefix=test_prefix())
    try:
        await a.store([StoreOp("n", (1,))])
        await b.store([StoreOp("n", (1,))])
        assert await a.purge() == 4  # registry, meta, minima, one bucket
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


async def test_keys_of_the_one_zset_layout_are_replaced(rindex: RedisIndex) -> None:
    """A node written by the one-ZSET layout (``P{node}:z``, meta without ``n``) reads as empty;
    the first write drops the old ZSET and keeps the capacity."""
    old = f"{rindex.keys.prefix}{{n}}:z"
    await rindex.client.zadd(old, {pack_hash(1): 2, pack_hash(2): 1})
    await rindex.client.hset(rindex.keys.meta("n"), mapping={"c": 50, "t": 2})
    assert await rindex.lookup([1, 2], ["n"]) == {"n": 0}
    assert await rindex.store([StoreOp("n", (1, 2, 3))]) == [True]
    assert not await rindex.client.exists(old)
    assert await rindex.lookup([1, 2, 3], ["n"]) == {"n": 3}
    assert (await rindex.stats()).nodes["n"].capacity == 50
