"""``open_index``: pick the index implementation from a URL (config, CLI ``--redis``)."""

from __future__ import annotations

from prefixgate.cachetier.index import DEFAULT_CAPACITY_BLOCKS, BlockIndex
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.redis_index import DEFAULT_TTL_SECONDS, RedisIndex
from prefixgate.cachetier.redis_schema import DEFAULT_LAYOUT, DEFAULT_PREFIX
from prefixgate.cachetier.resilient import ResilientIndex, ResyncHook

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_index(
    url: str | None,
    *,
    prefix: str = DEFAULT_PREFIX,
    layout: str = DEFAULT_LAYOUT,
    default_capacity: int = DEFAULT_CAPACITY_BLOCKS,
    ttl_seconds: int = DEFAULT_TTL_SECONDS,
    lookup_timeout: float = 0.005,
    call_timeout: float = 1.0,
    probe_interval: float = 0.5,
    failures_to_degrade: int = 5,
    mirror: bool = True,
    max_connections: int = 64,
    on_resync: ResyncHook | None = None,
) -> BlockIndex:
    """None / "" / "memory" → ``MemoryIndex``; ``redis://…`` → ``ResilientIndex(RedisIndex)``.

    Nothing connects here: the Redis client connects on first use, and an unreachable Redis
    only puts the index in degraded mode.
    """
    if url is None or url in ("", "memory", "memory://"):
        return MemoryIndex(default_capacity)
    if not url.startswith(REDIS_SCHEMES):
        raise ValueError(f"unsupported index URL {url!r}: use 'memory' or redis://host:port/db")
    primary = RedisIndex.from_url(  # single Redis or Cluster: asked of the server on first use
        url,
        max_connections=max_connections,
        timeout=call_timeout,
        prefix=prefix,
        layout=layout,
        default_capacity=default_capacity,
        ttl_seconds=ttl_seconds,
    )
    return ResilientIndex(
        primary,
        mirror=mirror,
        default_capacity=default_capacity,
        lookup_timeout=lookup_timeout,
        call_timeout=call_timeout,
        probe_interval=probe_interval,
        failures_to_degrade=failures_to_degrade,
        on_resync=on_resync,
    )
