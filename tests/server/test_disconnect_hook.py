"""The per-request disconnect hook that spares each request a task waiting on ``receive()``."""

from __future__ import annotations

import asyncio

from prefixgate.gateway.httpfront.connections import DisconnectHook


def test_fire_runs_the_registered_callbacks_once_and_not_the_unregistered() -> None:
    hook = DisconnectHook()
    calls: list[str] = []
    hook.register(lambda: calls.append("a"))
    unregister = hook.register(lambda: calls.append("b"))
    unregister()
    unregister()  # idempotent
    hook.fire()
    hook.fire()
    assert calls == ["a"]


async def test_a_callback_registered_after_the_client_left_runs_soon() -> None:
    hook = DisconnectHook()
    hook.fire()
    calls: list[str] = []
    hook.register(lambda: calls.append("late"))
    assert calls == []  # not from inside register: the caller is still setting up
    await asyncio.sleep(0)
    assert calls == ["late"]
