"""Redis-specific behaviour of the index: key schema, atomic batches, TTL, one-round-trip lookups."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time

import pytest
import redis.asyncio as aioredis

from prefixgate.cachetier.index import StoreOp
from prefixgate.cachetier.redis_index import RedisIndex
from prefixgate.cachetier.redis_schema import (
    BUCKET_FILL,
    ENTRY_BYTES,
    KeySchema,
    bucket_of,
    entries,
    pack_hash,
    pack_hashes,
    unpack_hash,
)
from tests.cachetier.support import test_prefix


async def test_key_schema_puts_each_node_in_one_hash_slot(rindex: RedisIndex) -> None:
    await rindex.store([StoreOp("p0", (1, 2, 3)), StoreOp("p1", (1,))])
    raw = await rindex.client.keys(rindex.keys.pattern)
    keys = sorted(k.decode() if isinstance(k, bytes) else k for k in raw)
    v = rindex.keys.prefix + "v2:"
    node_keys = [f"{v}{{{n}}}:{k}" for n in ("p0", "p1") for k in ("m", "h", "z")]
    assert keys == sorted([f"{v}nodes", *node_keys])
    # One bucket while small: 8-byte packed hashes, each with its tick, least recent first;
    # a chain is touched root last (the root is the most recent).
    bucket = await rindex.client.hget(rindex.keys.blocks("p0"), "0")
    assert isinstance(bucket, bytes) and len(bucket) == 3 * ENTRY_BYTES
    assert entries(bucket) == [pack_hash(3), pack_hash(2), pack_hash(1)]


async def test_buckets_split_one_at_a_time_and_stay_small(rindex: RedisIndex) -> None:
    """Linear hashing: a growing node splits buckets as it goes; each holds its own hashes."""
    rng = random.Random(3)
    chain = tuple(rng.getrandbits(64) for _ in range(5000))
    assert await rindex.store([StoreOp("n", chain)]) == [True]
    meta = await rindex.client.hgetall(rindex.keys.meta("n"))
    level, split = int(meta[b"L"]), int(meta[b"s"])
    assert int(meta[b"n"]) == 5000 and (1 << level) + split >= 5000 // BUCKET_FILL
    raw = await rindex.client.hgetall(rindex.keys.blocks("n"))
    buckets = {int(k): entries(bytes(v)) for k, v in raw.items()}  # type: ignore[arg-type]
    assert (
        sum(len(b) for b in buckets.values()) == 5000
        and max(len(b) for b in buckets.values()) <= 3 * BUCKET_FILL
    )
    for i, members in buckets.items():
        assert {bucket_of(unpack_hash(m), level, split) for m in members} == {i}
    assert await rindex.lookup((*chain, 7), ["n"]) == {"n": 5000}


async def test_the_previous_layout_is_ignored_and_can_be_dropped(rindex: RedisIndex) -> None:
    """Keys of the one-ZSET layout under the same prefix are never read, and go when asked."""
    p = rindex.keys.prefix
    await rindex.client.zadd(f"{p}{{old}}:z", {pack_hash(1): 1, pack_hash(2): 0})
    await rindex.client.hset(f"{p}{{old}}:m", mapping={"c": 10, "e": "x"})
    await rindex.client.zadd(f"{p}nodes", {"old": time.time()})
    await rindex.store([StoreOp("new", (1, 2))])
    assert await rindex.known_nodes() == ["new"]
    assert await rindex.lookup([1, 2], ["old", "new"]) == {"old": 0, "new": 2}
    assert (await rindex.stats()).total_blocks == 2
    assert await rindex.purge_legacy() == 3
    raw = await rindex.client.keys(rindex.keys.pattern)
    assert all((k.decode() if isinstance(k, bytes) else k).startswith(p + "v2:") for k in raw)
    assert await rindex.lookup([1, 2], ["new"]) == {"new": 2}


def test_prefix_must_not_break_the_hash_tag() -> None:
    with pytest.raises(ValueError):
        KeySchema("bad{prefix}:")
    assert KeySchema("a*b:").pattern == "a\\*b:*"


async def test_writes_set_and_refresh_the_ttl(url: str) -> None:
    index = RedisIndex.from_url(url, prefix=test_prefix(), ttl_seconds=120)
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


async def test_store_batch_is_atomic(rindex: RedisIndex, url: str) -> None:
    """A reader polling while a large multi-node batch lands sees all of it or none of it."""
    chains = {f"n{i}": tuple(range(1000 * i + 1, 1000 * i + 801)) for i in range(4)}
    ops = [StoreOp(n, c) for n, c in chains.items()]
    probe = aioredis.Redis.from_url(url)
    seen: set[tuple[int, ...]] = set()
    filled: set[tuple[bool, ...]] = set()
    done = asyncio.Event()

    async def poll() -> None:
        for _ in range(2000):
            if done.is_set():
                break
            pipe = probe.pipeline(transaction=True)
            for n in chains:
                pipe.hget(rindex.keys.meta(n), "n")
                pipe.hlen(rindex.keys.blocks(n))
            raw = await pipe.execute()
            seen.add(tuple(int(v or 0) for v in raw[0::2]))  # blocks counted
            filled.add(tuple(int(v) > 0 for v in raw[1::2]))  # blocks really there

    try:
        poller = asyncio.create_task(poll())
        await asyncio.sleep(0)
        assert await rindex.store(ops) == [True] * 4
        done.set()
        await poller
    finally:
        await probe.aclose()
    assert seen <= {(0, 0, 0, 0), (800, 800, 800, 800)}
    assert filled <= {(False,) * 4, (True,) * 4}
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
    big, big_held, _ = await rindex.memory_usage("big")
    small, small_held, _ = await rindex.memory_usage("small")
    assert (big_held, small_held) == (5000, 100)
    assert big / 5000 <= 40  # packed buckets (see README for the measured figure)
    assert small / 100 <= 30


async def test_purge_deletes_only_its_own_prefix(url: str) -> None:
    a = RedisIndex.from_url(url, prefix=test_prefix())
    b = RedisIndex.from_url(url, prefix=test_prefix())
    try:
        await a.store([StoreOp("n", (1,))])
        await b.store([StoreOp("n", (1,))])
        assert await a.purge() == 4
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
