"""Redis clients whose commands are never cancelled mid-flight: every Redis client the
gateway makes (the shared index, the shared state) comes from here.

Callers cancel Redis calls routinely: a deadline (``asyncio.timeout``) runs out, a request
whose client hung up is cancelled, a background loop is stopped. A command cancelled while
redis-py sends it or reads its reply costs its connection (redis-py drops the socket, the next
caller opens a new one: under sustained timeouts the pool churns through TCP connects and
handshakes), and on Python 3.11 the cancellation itself can be lost: redis-py sends under
``asyncio.wait_for``, which returns the inner result when the inner write completes in the loop
iteration the cancellation arrives in, and the caller carries on as if never cancelled.

So each command (``execute_command``, a pipeline's ``execute``; scripts and every typed
command go through ``execute_command``) runs in a task of its own, which the caller awaits
through ``asyncio.shield``. The caller's cancellation or deadline reaches the caller at once
and never the command: it runs to its end, bounded by the client's ``socket_timeout`` (and
the pool's wait), and its connection goes back to the pool whole. A command whose caller
left is *abandoned*; while ``max_abandoned`` of them still run (Redis stopped or very slow),
new commands fail at once with ``ConnectionError`` rather than pile up behind them. Closing
the client ends the tasks still running (``stop_tasks``) before the connections close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from prefixgate.cachetier.tasks import stop_tasks

T = TypeVar("T")

#: Commands whose caller left, per pool connection, that may still run before new ones fail fast.
ABANDONED_PER_CONNECTION = 4
#: How long closing a client waits for the commands still running to end (they are cancelled).
CLOSE_WAIT_S = 1.0


class Detached:
    """Runs each command in a task of its own (see module docstring); one per client, shared
    with the client's pipelines."""

    def __init__(self, max_abandoned: int) -> None:
        self.max_abandoned = max(1, max_abandoned)
        self.running: set[asyncio.Task[Any]] = set()
        self.abandoned: set[asyncio.Task[Any]] = set()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if len(self.abandoned) >= self.max_abandoned:
            coro.close()
            await asyncio.sleep(0)  # a caller that retries at once still lets them finish
            raise RedisConnectionError(
                f"{len(self.abandoned)} Redis commands whose callers left are still running"
            )
        task = asyncio.get_running_loop().create_task(coro)
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():  # it runs on, to release its connection whole
                self.abandoned.add(task)
                task.add_done_callback(self._left_behind_done)
            raise

    def _left_behind_done(self, task: asyncio.Task[Any]) -> None:
        """Its caller is gone: its outcome is nobody's (``shield`` no longer retrieves it)."""
        self.abandoned.discard(task)
        if not task.cancelled():
            task.exception()

    def inside(self) -> bool:
        """Whether the running task is one of these commands (redis-py closes its client from
        within a command to rediscover a cluster: that must not end the others)."""
        return asyncio.current_task() in self.running

    async def stop(self) -> int:
        """End the commands still running, within ``CLOSE_WAIT_S``; how many did not end."""
        return await stop_tasks(list(self.running), CLOSE_WAIT_S)


class DetachedPipeline(Pipeline):
    """A single-Redis pipeline (or MULTI/EXEC) whose ``execute`` runs in its own task."""

    detached: Detached

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        return await self.detached.run(super().execute(raise_on_error))


class DetachedRedis(aioredis.Redis):
    """A single-Redis client whose commands are never cancelled mid-flight."""

    def __init__(self, *args: Any, max_abandoned: int = 64, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.detached = Detached(max_abandoned)

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        command = super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        return await self.detached.run(command)

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> DetachedPipeline:
        pipe = DetachedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.detached = self.detached
        return pipe

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        if not self.detached.inside():
            await self.detached.stop()
        await super().aclose(close_connection_pool)


class DetachedClusterPipeline(ClusterPipeline):
    """A Redis Cluster pipeline whose ``execute`` runs in its own task."""

    detached: Detached

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        return await self.detached.run(super().execute(raise_on_error, allow_redirections))


class DetachedRedisCluster(RedisCluster):
    """A Redis Cluster client whose commands are never cancelled mid-flight."""

    def __init__(self, *args: Any, max_abandoned: int = 64, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.detached = Detached(max_abandoned)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await self.detached.run(super().execute_command(*args, **kwargs))

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None
    ) -> DetachedClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        # redis-py's command mixins declare ``_event_dispatcher`` as a protocol member that
        # ``ClusterPipeline`` never sets (nor reads): not abstract in fact
        pipe = DetachedClusterPipeline(self, transaction)  # type: ignore[abstract]
        pipe.detached = self.detached
        return pipe

    async def aclose(self) -> None:
        if not self.detached.inside():
            await self.detached.stop()
        await super().aclose()


def connect(url: str, *, max_connections: int = 64, timeout: float = 2.0) -> DetachedRedis:
    """A single-Redis client: bounded pool, short timeouts, one quick retry.

    Callers put their own deadline on top; long client-side retries would only hold requests.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 1),
    )
    client = DetachedRedis(connection_pool=pool, max_abandoned=ABANDONED_PER_CONNECTION * max_connections)
    client.auto_close_connection_pool = True  # the client owns its pool, as ``Redis.from_pool``
    return client


def connect_cluster(url: str, *, max_connections: int = 64, timeout: float = 2.0) -> DetachedRedisCluster:
    """A Redis Cluster client from the address of any one of its nodes (it learns the rest)."""
    client = DetachedRedisCluster.from_url(
        url,
        max_connections=max_connections,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 2),
        max_abandoned=ABANDONED_PER_CONNECTION * max_connections,
    )
    assert isinstance(client, DetachedRedisCluster)
    return client


async def is_cluster(client: aioredis.Redis) -> bool:
    """Whether the server behind ``client`` runs in cluster mode (``INFO cluster``)."""
    info = await client.info("cluster")
    return bool(int(info.get("cluster_enabled", 0)))
