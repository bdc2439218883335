"""Stopping a background task for sure.

``task.cancel()`` asks once, and on Python 3.11 the request can be lost: ``asyncio.wait_for``
returns the inner result when the inner call completes in the loop iteration the cancellation
arrives in, as if it never came. redis-py sends every command under ``wait_for`` (its socket
timeout), so a background loop cancelled while it talked to Redis now and then carried on; a
``close`` that awaits it then waits until the next cancellation, which may never come (a Redis
Cluster replica's shutdown hung in its membership loop this way). The clients of
``redis_clients`` now run each command in a task of its own, so a caller is never inside that
``wait_for`` and its cancellation always arrives; ``stop_task`` stays as the safety net for
any other call that could swallow one: it cancels again until the task is done, within a
bound, and waits with ``asyncio.wait``: awaiting the task under ``suppress(CancelledError)``
would also swallow the caller's own cancellation.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: After the first cancellation, how long the task is given to unwind before it is asked again.
FIRST_WAIT_S = 0.1
#: Then, how often it is asked again.
RECANCEL_S = 0.05


async def stop_task(task: asyncio.Future[Any] | None, timeout: float = 2.0) -> bool:
    """Cancel ``task`` until it is done, for at most ``timeout`` s; True if it ended.

    Its outcome (result, error, cancellation) is consumed: the task is being thrown away."""
    if task is None:
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    wait = FIRST_WAIT_S
    while not task.done():
        task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        await asyncio.wait({task}, timeout=min(wait, left))
        wait = RECANCEL_S
    if task.done() and not task.cancelled():
        task.exception()  # retrieved, so never reported as "never retrieved"
    return task.done()


async def stop_tasks(tasks: list[asyncio.Future[Any]], timeout: float = 2.0) -> int:
    """``stop_task`` for each, at once; how many did not end within ``timeout``."""
    ended = await asyncio.gather(*(stop_task(t, timeout) for t in tasks))
    return sum(1 for ok in ended if not ok)
