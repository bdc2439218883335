"""Redis implementation of ``BlockIndex``: one index shared by every gateway replica.

Key schema: ``redis_schema.py``; scripts of the two layouts (``zset``, the default, and
``packed``): ``redis_scripts_zset.py``, ``redis_scripts_packed.py``; see ``cachetier/README.md``.
Runs on a single Redis or a Redis Cluster, told apart by asking the server (``INFO cluster``)
on first use:

- single Redis: a lookup is one EVALSHA (one round trip) that binary-searches every node's
  blocks; a store batch is one MULTI/EXEC holding one script call per node, so no half-written
  batch is ever visible;
- Cluster: a lookup is one EVALSHA per shard (its nodes' keys, the prompt's hashes once), to
  all shards in parallel: one round trip; a store batch is one script call per
  node (a node's keys share a hash tag, so each node's part is atomic; a batch spanning nodes
  is not). ``MOVED``/``ASK``/failover are the cluster client's; ``NOSCRIPT`` is reloaded here.

Every node's meta hash carries an epoch token; ``check`` compares it with the token last seen
to find nodes whose data Redis lost (restart, flush, expiry, failover to a lagging replica).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import NoScriptError, SlotNotCoveredError

from prefixgate.cachetier import redis_scripts_packed, redis_scripts_zset
from prefixgate.cachetier.index import DEFAULT_CAPACITY_BLOCKS, IndexStats, NodeOccupancy, StoreOp
from prefixgate.cachetier.redis_clients import connect as connect
from prefixgate.cachetier.redis_clients import connect_cluster as connect_cluster
from prefixgate.cachetier.redis_clients import is_cluster as is_cluster
from prefixgate.cachetier.redis_schema import (
    DEFAULT_LAYOUT,
    DEFAULT_PREFIX,
    KeySchema,
    entries,
    pack_hash,
    pack_hashes,
    unpack_hash,
)

DEFAULT_TTL_SECONDS = 3600
Client = aioredis.Redis | RedisCluster
_Call = tuple[str, list[str], list[Any]]  # script name, keys, args
_REMOVE_CHUNK = 4096


class RedisIndex:
    """``BlockIndex`` over Redis or Redis Cluster (see module docstring); all replicas agree."""

    backend = "redis"

    def __init__(
        self,
        client: Client,
        *,
        prefix: str = DEFAULT_PREFIX,
        layout: str = DEFAULT_LAYOUT,
        default_capacity: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        nodes_refresh: float = 1.0,
        owns_client: bool = True,
        url: str | None = None,
        max_connections: int = 64,
        timeout: float = 2.0,
    ) -> None:
        """``url`` set: on first use, ask the server and switch to the cluster client if needed."""
        if ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be positive")
        self.client: Client = client
        self.keys = KeySchema(prefix, layout)
        self.default_capacity = max(0, default_capacity)
        self.ttl_seconds = ttl_seconds
        self.nodes_refresh = nodes_refresh
        self._owns_client = owns_client
        self._url = url
        self._max_connections = max_connections
        self._timeout = timeout
        self._mode_known = isinstance(client, RedisCluster) or url is None
        self._mode_lock: asyncio.Lock | None = None
        scripts = _PACKED_SCRIPTS if self.keys.packed else _ZSET_SCRIPTS
        self._scripts = {name: (text, _sha1(text)) for name, text in scripts.items()}
        self._known: set[str] = set()
        self._known_at = float("-inf")
        self._epochs: dict[str, bytes] = {}  # node -> epoch last seen
        self._capacity: dict[str, int] = {}  # node -> capacity last set (restored after data loss)
        self._owners: dict[str, str] = {}  # Cluster: node -> primary serving its slot
        self._lost: set[str] = set()

    @classmethod
    def from_url(
        cls, url: str, *, max_connections: int = 64, timeout: float = 2.0, **kwargs: Any
    ) -> RedisIndex:
        """Single Redis or Cluster, whichever ``url`` points at (decided on first use)."""
        return cls(
            connect(url, max_connections=max_connections, timeout=timeout),
            url=url,
            max_connections=max_connections,
            timeout=timeout,
            **kwargs,
        )

    @property
    def cluster(self) -> bool:
        return isinstance(self.client, RedisCluster)

    async def connected(self) -> Client:
        """The client, after finding out (once) whether the server is a cluster node."""
        if self._mode_known:
            return self.client
        if self._mode_lock is None:
            self._mode_lock = asyncio.Lock()
        async with self._mode_lock:
            if not self._mode_known:
                single = self.client
                assert isinstance(single, aioredis.Redis) and self._url is not None
                if await is_cluster(single):
                    cluster = connect_cluster(
                        self._url, max_connections=self._max_connections, timeout=self._timeout
                    )
                    await cluster.initialize()
                    self.client = cluster
                    await single.aclose()
                self._mode_known = True
        return self.client

    # -- reads ---------------------------------------------------------------------------

    async def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None = None) -> dict[str, int]:
        names = list(dict.fromkeys(nodes)) if nodes is not None else await self.known_nodes()
        if not names:
            return {}
        if not hashes:
            return dict.fromkeys(names, 0)
        blob = pack_hashes(hashes)
        client = await self.connected()
        if isinstance(client, RedisCluster):
            return await self._lookup_by_shard(client, names, blob)
        keys = [self.keys.lookup_key(n) for n in names]
        runs = await self._eval(client, "lookup", keys, [blob])
        return {n: int(r) for n, r in zip(names, runs, strict=True)}

    async def _lookup_by_shard(self, client: RedisCluster, names: list[str], blob: bytes) -> dict[str, int]:
        """One script call per shard, all shards at once: one round trip, the prompt's hashes
        sent once per shard."""
        shards: dict[str, tuple[ClusterNode, list[str]]] = {}
        for n in names:
            primary = client.get_node_from_key(self.keys.lookup_key(n))
            if primary is None:
                raise SlotNotCoveredError(f"no primary serves node {n!r}")
            shards.setdefault(primary.name, (primary, []))[1].append(n)
        runs: dict[str, int] = {}

        async def on_shard(primary: ClusterNode, nodes: list[str]) -> None:
            keys = [self.keys.lookup_key(n) for n in nodes]
            text, sha = self._scripts["lookup_shard"]
            try:
                res = await client.execute_command("EVALSHA", sha, 0, blob, *keys, target_nodes=primary)
            except NoScriptError:
                await client.script_load(text)
                res = await client.execute_command("EVALSHA", sha, 0, blob, *keys, target_nodes=primary)
            runs.update((n, int(r)) for n, r in zip(nodes, res, strict=True))

        await asyncio.gather(*(on_shard(primary, nodes) for primary, nodes in shards.values()))
        return {n: runs[n] for n in names}

    async def known_nodes(self) -> list[str]:
        """Nodes written within the TTL; cached for ``nodes_refresh`` s (own writes at once)."""
        now = time.monotonic()
        if now - self._known_at >= self.nodes_refresh:
            client = await self.connected()
            since = time.time() - self.ttl_seconds
            raw = await client.zrangebyscore(self.keys.registry, since, "+inf")
            self._known = {_text(m) for m in raw}
            self._known_at = now
        return sorted(self._known)

    async def node_hashes(self, node: str) -> set[int]:
        client = await self.connected()
        if not self.keys.packed:
            members = await client.zrange(self.keys.blocks(node), 0, -1)
            return {unpack_hash(_bytes(m)) for m in members}
        buckets = await client.hvals(self.keys.blocks(node))
        return {unpack_hash(m) for b in buckets for m in entries(_bytes(b))}

    async def memory_usage(self, node: str) -> tuple[int, int, str]:
        """(bytes, blocks, encoding of its blocks key): ``MEMORY USAGE`` summed over the node's
        block keys (zset: the block ZSET; packed: buckets, bounds and meta), blocks held."""
        client = await self.connected()
        keys = self.keys.node_keys(node) if self.keys.packed else [self.keys.blocks(node)]
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.memory_usage(k, samples=0)
        if self.keys.packed:
            pipe.hget(self.keys.meta(node), "n")
        else:
            pipe.zcard(self.keys.blocks(node))
        pipe.object("encoding", self.keys.blocks(node))
        raw = await pipe.execute()
        usage = sum(int(v or 0) for v in raw[: len(keys)])
        enc = raw[-1]
        return usage, int(raw[-2] or 0), enc.decode() if isinstance(enc, bytes) else str(enc or "")

    async def stats(self) -> IndexStats:
        self._known_at = float("-inf")
        names = await self.known_nodes()
        client = await self.connected()
        pipe = client.pipeline(transaction=False)
        for n in names:
            if self.keys.packed:
                pipe.hmget(self.keys.meta(n), ["n", "c"])
            else:
                pipe.zcard(self.keys.blocks(n))
                pipe.hget(self.keys.meta(n), "c")
        raw = await pipe.execute()
        pairs = raw if self.keys.packed else list(zip(raw[0::2], raw[1::2], strict=True))
        occ: dict[str, NodeOccupancy] = {}
        for n, (held, cap) in zip(names, pairs, strict=True):
            blocks = int(held) if held is not None else 0
            occ[n] = NodeOccupancy(n, blocks, int(cap) if cap is not None else self.default_capacity)
        return IndexStats(self.backend, sum(o.blocks for o in occ.values()), occ)

    async def ping(self) -> None:
        client = await self.connected()
        if isinstance(client, RedisCluster):
            await client.zcard(self.keys.registry)  # keyed: routed and re-routed like real traffic
        else:
            await client.ping()

    async def check(self, *, write: bool = False) -> set[str]:
        """Nodes whose data Redis lost since this client last saw them; ``write`` also proves
        that Redis accepts writes (raises when it refuses them, e.g. out of memory)."""
        nodes = list(self._epochs)
        lost, self._lost = self._lost, set()
        if not nodes:
            if write:
                await self.ping()
            return lost
        client = await self.connected()
        calls = [("epoch", [self.keys.meta(n)], ["1" if write else "0"]) for n in nodes]
        raw = await self._pipeline_scripts(client, calls)
        for node, epoch in zip(nodes, raw, strict=True):
            seen = self._epochs.get(node)
            if not epoch:
                self._epochs.pop(node, None)  # learnt again at the node's next write
                lost.add(node)
            elif seen is not None and epoch != seen:
                self._epochs[node] = _bytes(epoch)
                lost.add(node)
        if isinstance(client, RedisCluster):
            lost |= self._failed_over(client, nodes)
        return lost

    def _failed_over(self, client: RedisCluster, nodes: Iterable[str]) -> set[str]:
        """Nodes whose slot is now served by another primary: writes the old one acknowledged
        may never have reached the replica that took over."""
        moved: set[str] = set()
        for node in nodes:
            key = self.keys.meta(node)
            owner = client.get_node_from_key(key)
            name = owner.name if owner is not None else ""
            before = self._owners.get(node)
            self._owners[node] = name
            if before is not None and before != name:
                moved.add(node)
        return moved

    # -- writes --------------------------------------------------------------------------

    async def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        if not ops:
            return []
        by_node: dict[str, list[int]] = defaultdict(list)
        for i, op in enumerate(ops):
            by_node[op.node].append(i)
        calls: list[_Call] = []
        for node, idx in by_node.items():
            args = self._store_head(node, "s")
            for i in idx:
                op = ops[i]
                args.append(pack_hash(op.parent) if op.parent else b"")
                args.append(pack_hashes(op.hashes))
            calls.append(("store", self._node_keys(node), args))
        results = await self._write_calls(calls, register=list(by_node))
        out = [False] * len(ops)
        for (node, idx), res in zip(by_node.items(), results, strict=True):
            self._saw_epoch(node, res[-1])
            for i, ok in zip(idx, res[:-1], strict=True):
                out[i] = bool(ok)
        return out

    async def replace_node(self, node: str, chains: Sequence[Sequence[int]]) -> None:
        args = self._store_head(node, "r")
        for chain in chains:
            args += [b"", pack_hashes(chain)]
        res = await self._write_calls([("store", self._node_keys(node), args)], register=[node])
        self._epochs.pop(node, None)  # a replaced node is whole again, whatever its epoch was
        self._lost.discard(node)
        self._saw_epoch(node, res[0][-1])

    async def set_capacity(self, node: str, blocks: int) -> None:
        blocks = max(0, blocks)
        args = [blocks, self.ttl_seconds, _new_epoch()]
        res = await self._write_calls([("set_capacity", self._node_keys(node), args)], register=[node])
        self._capacity[node] = blocks
        self._saw_epoch(node, res[0])

    async def remove(self, node: str, hashes: Iterable[int]) -> int:
        members = list(dict.fromkeys(pack_hash(h) for h in hashes))
        if not members:
            return 0
        client = await self.connected()
        if self.keys.packed:
            call = ("remove", self._node_keys(node), [self.ttl_seconds, b"".join(members)])
            return int((await self._pipeline_scripts(client, [call]))[0])
        key = self.keys.blocks(node)
        pipe = client.pipeline(transaction=True)  # one slot: a transaction on Cluster too
        for i in range(0, len(members), _REMOVE_CHUNK):
            pipe.zrem(key, *members[i : i + _REMOVE_CHUNK])
        pipe.expire(key, self.ttl_seconds)
        pipe.expire(self.keys.meta(node), self.ttl_seconds)
        raw = await pipe.execute()
        return sum(int(r) for r in raw[:-2])

    async def clear_node(self, node: str) -> int:
        client = await self.connected()
        if self.keys.packed:
            return int((await self._pipeline_scripts(client, [("clear", self._node_keys(node), [])]))[0])
        pipe = client.pipeline(transaction=True)
        pipe.zcard(self.keys.blocks(node))
        pipe.delete(self.keys.blocks(node))
        raw = await pipe.execute()
        return int(raw[0])

    async def purge(self) -> int:
        """Delete every key under this prefix (tests, benchmarks, an operator's reset)."""
        client = await self.connected()
        keys = [k async for k in client.scan_iter(match=self.keys.pattern, count=1000)]
        n = 0
        for i in range(0, len(keys), 1000):
            pipe = client.pipeline(transaction=False)
            for k in keys[i : i + 1000]:
                pipe.execute_command("UNLINK", k)
            n += sum(int(r) for r in await pipe.execute())
        self._known = set()
        self._epochs.clear()
        return n

    async def purge_other_layout(self) -> int:
        """Delete the keys the other layout left under this prefix (after switching layouts;
        they would expire by their TTL anyway, and nothing here reads them)."""
        client = await self.connected()
        keys = [k async for k in client.scan_iter(match=self.keys.pattern, count=1000)]
        old = [k for k in keys if self.keys.of_other_layout(k.decode() if isinstance(k, bytes) else str(k))]
        n = 0
        for i in range(0, len(old), 1000):
            pipe = client.pipeline(transaction=False)
            for k in old[i : i + 1000]:
                pipe.execute_command("UNLINK", k)
            n += sum(int(r) for r in await pipe.execute())
        return n

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    # -- plumbing ------------------------------------------------------------------------

    def _node_keys(self, node: str) -> list[str]:
        return self.keys.node_keys(node)

    def _store_head(self, node: str, mode: str) -> list[bytes | str | int]:
        cap = self._capacity.get(node, self.default_capacity)
        return [cap, self.ttl_seconds, mode, _new_epoch()]

    def _saw_epoch(self, node: str, epoch: object) -> None:
        """A write returned the node's epoch: another one than before means the data was lost."""
        if not isinstance(epoch, bytes):
            return
        seen = self._epochs.get(node)
        if seen is not None and seen != epoch:
            self._lost.add(node)
        self._epochs[node] = epoch

    async def _eval(self, client: aioredis.Redis, script: str, keys: list[str], args: list[Any]) -> Any:
        text, sha = self._scripts[script]
        try:
            return await client.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(text)
            return await client.evalsha(sha, len(keys), *keys, *args)

    async def _pipeline_scripts(self, client: Client, calls: list[_Call]) -> list[Any]:
        """Script calls in one pipeline: one round trip (per shard, in parallel, on Cluster)."""
        for attempt in (0, 1):
            pipe = client.pipeline(transaction=False)
            for script, keys, args in calls:
                pipe.execute_command("EVALSHA", self._scripts[script][1], len(keys), *keys, *args)
            try:
                return list(await pipe.execute())
            except NoScriptError:
                if attempt:
                    raise
                await self._load_scripts(client)
        raise AssertionError("unreachable")

    async def _load_scripts(self, client: Client) -> None:
        for text, _ in self._scripts.values():
            await client.script_load(text)  # on Cluster: every primary

    async def _write_calls(self, calls: list[_Call], register: list[str]) -> list[Any]:
        """Script calls plus the registry update: one MULTI/EXEC on a single Redis (the batch is
        atomic); on Cluster one pipeline (each node's script call is atomic by itself)."""
        client = await self.connected()
        cluster = isinstance(client, RedisCluster)
        for attempt in (0, 1):
            pipe = client.pipeline(transaction=not cluster)
            for script, keys, args in calls:
                pipe.execute_command("EVALSHA", self._scripts[script][1], len(keys), *keys, *args)
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
                await self._load_scripts(client)
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


def _new_epoch() -> str:
    """The token a write puts into a node's meta if it has none: differs from any before."""
    return secrets.token_hex(8)


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


_ZSET_SCRIPTS = {
    "lookup": redis_scripts_zset.LOOKUP_LUA,
    "lookup_shard": redis_scripts_zset.LOOKUP_SHARD_LUA,
    "store": redis_scripts_zset.STORE_LUA,
    "set_capacity": redis_scripts_zset.SET_CAPACITY_LUA,
    "epoch": redis_scripts_zset.EPOCH_LUA,
}
_PACKED_SCRIPTS = {
    "lookup": redis_scripts_packed.LOOKUP_LUA,
    "lookup_shard": redis_scripts_packed.LOOKUP_SHARD_LUA,
    "store": redis_scripts_packed.STORE_LUA,
    "set_capacity": redis_scripts_packed.SET_CAPACITY_LUA,
    "remove": redis_scripts_packed.REMOVE_LUA,
    "clear": redis_scripts_packed.CLEAR_LUA,
    "epoch": redis_scripts_packed.EPOCH_LUA,
}
