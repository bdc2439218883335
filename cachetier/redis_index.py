"""Redis implementation of ``BlockIndex``: one index shared by every gateway replica.

Key schema and scripts: ``redis_schema.py`` and ``cachetier/README.md``. A lookup is one
EVALSHA (one round trip) that binary-searches every node's ZSET; a store batch is one
MULTI/EXEC holding one script call per node, so no half-written batch is ever visible.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError

from cachetier.index import DEFAULT_CAPACITY_BLOCKS, IndexStats, NodeOccupancy, StoreOp
from cachetier.redis_schema import (
    DEFAULT_PREFIX,
    LOOKUP_LUA,
    SET_CAPACITY_LUA,
    STORE_LUA,
    KeySchema,
    pack_hash,
    pack_hashes,
    unpack_hash,
)

DEFAULT_TTL_SECONDS = 3600
_Call = tuple[str, list[str], list[Any]]  # script name, keys, args
_REMOVE_CHUNK = 4096


def connect(url: str, *, max_connections: int = 64, timeout: float = 2.0) -> aioredis.Redis:
    """A client for the index: bounded pool, short timeouts, one quick retry.

    Callers (the resilient wrapper) put their own deadline on top; long client-side retries
    would only hold requests.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 1),
    )
    return aioredis.Redis.from_pool(pool)


class RedisIndex:
    """``BlockIndex`` over Redis (see module docstring); all replicas see the same state."""

    backend = "redis"

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        default_capacity: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        nodes_refresh: float = 1.0,
        owns_client: bool = True,
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be positive")
        self.client = client
        self.keys = KeySchema(prefix)
        self.default_capacity = max(0, default_capacity)
        self.ttl_seconds = ttl_seconds
        self.nodes_refresh = nodes_refresh
        self._owns_client = owns_client
        self._scripts = {name: (text, _sha1(text)) for name, text in _SCRIPTS.items()}
        self._known: set[str] = set()
        self._known_at = float("-inf")

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisIndex:
        return cls(connect(url), **kwargs)

    # -- reads ---------------------------------------------------------------------------

    async def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None = None) -> dict[str, int]:
        names = list(dict.fromkeys(nodes)) if nodes is not None else await self.known_nodes()
        if not names:
            return {}
        if not hashes:
            return dict.fromkeys(names, 0)
        keys = [self.keys.blocks(n) for n in names]
        runs = await self._eval("lookup", keys, [pack_hashes(hashes)])
        return {n: int(r) for n, r in zip(names, runs, strict=True)}

    async def known_nodes(self) -> list[str]:
        """Nodes written within the TTL; cached for ``nodes_refresh`` s (own writes at once)."""
        now = time.monotonic()
        if now - self._known_at >= self.nodes_refresh:
            since = time.time() - self.ttl_seconds
            raw = await self.client.zrangebyscore(self.keys.registry, since, "+inf")
            self._known = {_text(m) for m in raw}
            self._known_at = now
        return sorted(self._known)

    async def node_hashes(self, node: str) -> set[int]:
        members = await self.client.zrange(self.keys.blocks(node), 0, -1)
        return {unpack_hash(_bytes(m)) for m in members}

    async def stats(self) -> IndexStats:
        self._known_at = float("-inf")
        names = await self.known_nodes()
        pipe = self.client.pipeline(transaction=False)
        for n in names:
            pipe.zcard(self.keys.blocks(n))
            pipe.hget(self.keys.meta(n), "c")
        raw = await pipe.execute()
        occ: dict[str, NodeOccupancy] = {}
        for i, n in enumerate(names):
            cap = raw[2 * i + 1]
            occ[n] = NodeOccupancy(n, int(raw[2 * i]), int(cap) if cap is not None else self.default_capacity)
        return IndexStats(self.backend, sum(o.blocks for o in occ.values()), occ)

    async def ping(self) -> None:
        await self.client.ping()

    # -- writes --------------------------------------------------------------------------

    async def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        if not ops:
            return []
        by_node: dict[str, list[int]] = defaultdict(list)
        for i, op in enumerate(ops):
            by_node[op.node].append(i)
        calls: list[_Call] = []
        for node, idx in by_node.items():
            args: list[bytes | str | int] = [self.default_capacity, self.ttl_seconds, "s"]
            for i in idx:
                op = ops[i]
                args.append(pack_hash(op.parent) if op.parent else b"")
                args.append(pack_hashes(op.hashes))
            calls.append(("store", [self.keys.blocks(node), self.keys.meta(node)], args))
        results = await self._transaction(calls, register=list(by_node))
        out = [False] * len(ops)
        for (_, idx), res in zip(by_node.items(), results, strict=False):
            for i, ok in zip(idx, res, strict=True):
                out[i] = bool(ok)
        return out

    async def replace_node(self, node: str, chains: Sequence[Sequence[int]]) -> None:
        args: list[bytes | str | int] = [self.default_capacity, self.ttl_seconds, "r"]
        for chain in chains:
            args += [b"", pack_hashes(chain)]
        await self._transaction(
            [("store", [self.keys.blocks(node), self.keys.meta(node)], args)], register=[node]
        )

    async def set_capacity(self, node: str, blocks: int) -> None:
        args = [max(0, blocks), self.ttl_seconds]
        await self._transaction(
            [("set_capacity", [self.keys.blocks(node), self.keys.meta(node)], args)], register=[node]
        )

    async def remove(self, node: str, hashes: Iterable[int]) -> int:
        members = list(dict.fromkeys(pack_hash(h) for h in hashes))
        if not members:
            return 0
        key = self.keys.blocks(node)
        pipe = self.client.pipeline(transaction=True)
        for i in range(0, len(members), _REMOVE_CHUNK):
            pipe.zrem(key, *members[i : i + _REMOVE_CHUNK])
        pipe.expire(key, self.ttl_seconds)
        pipe.expire(self.keys.meta(node), self.ttl_seconds)
        raw = await pipe.execute()
        return sum(int(r) for r in raw[:-2])

    async def clear_node(self, node: str) -> int:
        pipe = self.client.pipeline(transaction=True)
        pipe.zcard(self.keys.blocks(node))
        pipe.delete(self.keys.blocks(node))
        raw = await pipe.execute()
        return int(raw[0])

    async def purge(self) -> int:
        """Delete every key under this prefix (tests, benchmarks, an operator's reset)."""
        n = 0
        batch: list[bytes] = []
        async for key in self.client.scan_iter(match=self.keys.pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                n += await self.client.unlink(*batch)
                batch = []
        if batch:
            n += await self.client.unlink(*batch)
        self._known = set()
        return n

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    # -- plumbing ------------------------------------------------------------------------

    async def _eval(self, script: str, keys: list[str], args: list[Any]) -> Any:
        text, sha = self._scripts[script]
        try:
            return await self.client.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.client.script_load(text)
            return await self.client.evalsha(sha, len(keys), *keys, *args)

    async def _transaction(self, calls: list[_Call], register: list[str]) -> list[Any]:
        """Run script calls and the registry update in one MULTI/EXEC (atomic batch)."""
        for attempt in (0, 1):
            pipe = self.client.pipeline(transaction=True)
            for script, keys, args in calls:
                pipe.evalsha(self._scripts[script][1], len(keys), *keys, *args)
            now = time.time()
            reg = self.keys.registry
            pipe.zadd(reg, dict.fromkeys(register, now))
            pipe.zremrangebyscore(reg, "-inf", f"({now - self.ttl_seconds}")
            pipe.expire(reg, self.ttl_seconds)
            try:
                raw = await pipe.execute()
            except NoScriptError:
                if attempt:
                    raise
                for text, _ in self._scripts.values():
                    await self.client.script_load(text)
                continue
            self._known.update(register)
            return list(raw[: len(calls)])
        raise AssertionError("unreachable")


def _bytes(v: object) -> bytes:
    if not isinstance(v, bytes):
        raise TypeError(f"expected bytes from Redis, got {type(v).__name__}")
    return v


def _text(v: object) -> str:
    return _bytes(v).decode()


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


_SCRIPTS = {"lookup": LOOKUP_LUA, "store": STORE_LUA, "set_capacity": SET_CAPACITY_LUA}
