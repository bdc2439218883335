"""Redis calls cancelled at random points, as callers cancel them in the gateway: a deadline
(``asyncio.timeout``) that runs out, or the caller's task cancelled (a request that went away).

Shared by the single-Redis and the Redis Cluster tests of the clients the gateway makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from prefixgate.cachetier.redis_index import Client

#: A call whose deadline ran out (or whose task was cancelled) yet which returned normally:
#: the cancellation was lost.
LOST = "lost"


async def one_call(client: Client, key: str, i: int, cluster: bool) -> Any:
    """One of the kinds of call the gateway makes: a command, a pipeline or MULTI/EXEC, a script."""
    kind = i % 4
    if kind == 0:
        return await client.get(key)
    if kind == 1:
        return await client.set(key, b"v" * (1 + i % 300))
    if kind == 2:
        pipe = client.pipeline(transaction=not cluster)
        pipe.incr(key + ":n")
        pipe.expire(key + ":n", 60)
        return await pipe.execute()
    return await client.eval("return redis.call('INCR', KEYS[1])", 1, key + ":s")  # type: ignore[misc]


async def cancel_storm(
    client: Client,
    prefix: str,
    *,
    cluster: bool = False,
    workers: int = 8,
    calls: int = 600,
    seconds: float = 3.0,
    seed: int = 1,
) -> Counter[str]:
    """``calls`` calls from ``workers`` at once (within ``seconds``), each cancelled at a random
    point of its first ~2 ms: half by a deadline, half by cancelling the caller's task. Callers
    come no faster than a few pools' worth per millisecond, about what a loopback Redis serves.

    Returns how each ended: ``ok`` (done before the cancellation), ``cancelled``, ``timeout``,
    ``LOST`` (cancelled, yet returned as if not), or the error's type name."""
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    left = calls

    async def by_deadline(i: int) -> str:
        timeout = asyncio.timeout(rng.random() * 0.002)
        try:
            async with timeout:
                await one_call(client, f"{prefix}{i % 40}", i, cluster)
        except TimeoutError:
            return "timeout"
        return LOST if timeout.expired() else "ok"

    async def by_cancel(i: int) -> str:
        task = asyncio.ensure_future(one_call(client, f"{prefix}{i % 40}", i, cluster))
        await asyncio.sleep(rng.random() * 0.002)
        hit = task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return LOST if hit else "ok"

    async def worker() -> None:
        nonlocal left
        while left > 0 and time.monotonic() < deadline:
            left -= 1
            i = left
            try:
                outcome = await (by_deadline(i) if i % 2 else by_cancel(i))
            except RedisConnectionError as exc:  # failed fast (too many abandoned), or no connection
                outcome = type(exc).__name__
            outcomes[outcome] += 1
            await asyncio.sleep(rng.random() * 0.001)  # callers come and go, at about what Redis serves

    await asyncio.gather(*(worker() for _ in range(workers)))
    return outcomes


async def serves(client: Client, prefix: str, n: int, timeout: float = 5.0) -> None:
    """``n`` calls at once all succeed: the pool has every connection back."""
    async with asyncio.timeout(timeout):
        await asyncio.gather(*(client.set(f"{prefix}after:{i}", i) for i in range(n)))
        assert await client.get(f"{prefix}after:0") == b"0"


async def settled(client: Client, timeout: float = 5.0) -> None:
    """Until the commands whose callers left have ended (none on a client without them)."""
    detached = getattr(client, "detached", None)
    loop_deadline = time.monotonic() + timeout
    while detached is not None and detached.running and time.monotonic() < loop_deadline:
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def unhandled() -> Iterator[list[dict[str, Any]]]:
    """What the loop would log as unhandled (a task's exception never retrieved, ...), garbage
    collected at the end so that a task dropped with its exception is counted."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        yield seen
        gc.collect()
    finally:
        loop.set_exception_handler(before)
