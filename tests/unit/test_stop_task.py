"""Stopping background work at shutdown when a cancellation is lost (``cachetier.tasks``) and
bounding a close that ignores it (``gateway.shutdown.stage``)."""

from __future__ import annotations

import asyncio
import sys
import time

from prefixgate.cachetier.tasks import stop_task
from prefixgate.gateway import shutdown


async def test_a_loop_whose_cancellation_was_lost_in_wait_for_is_still_stopped() -> None:
    """The Redis client sends each command under ``asyncio.wait_for``; on Python 3.11 a
    cancellation arriving as the command completes is lost and the loop carries on."""
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    rounds = 0

    async def background() -> None:
        nonlocal gate, rounds
        while True:
            gate = loop.create_future()
            await asyncio.wait_for(gate, 5)  # a command, answered by the test
            rounds += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(background())
    await asyncio.sleep(0.01)  # inside wait_for
    gate.set_result(None)
    task.cancel()  # in the same iteration as the answer
    done, _ = await asyncio.wait({task}, timeout=0.2)
    if sys.version_info < (3, 12):  # the lost cancellation: the loop went on
        assert not done and rounds >= 1
    t0 = time.monotonic()
    assert await stop_task(task, timeout=2.0)
    assert task.done() and time.monotonic() - t0 < 1.0


async def test_a_stage_that_ignores_its_cancellation_is_left_behind_at_its_bound() -> None:
    release = asyncio.Event()

    async def stubborn_close() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # as a close awaiting a task under suppress(CancelledError)

    t0 = time.monotonic()
    outcome = await shutdown.stage("stubborn", stubborn_close, 0.2)
    took = time.monotonic() - t0
    assert outcome == "timeout" and took < 0.2 + shutdown.CANCEL_GRACE_S + 0.3
    assert await shutdown.stage("quick", lambda: asyncio.sleep(0), 1.0) == "ok"
    # the abandoned stage is still running (what end_leftovers ends in the gateway's process)
    (left,) = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "stubborn_close"]  # type: ignore[union-attr]
    release.set()
    assert await stop_task(left, timeout=1.0)
