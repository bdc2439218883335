"""Redis calls cancelled mid-command (deadline, or caller gone) on the clients the gateway makes
(``cachetier.redis_clients``): no cancellation is lost, no connection is lost or churned, the
pool serves afterwards, and while Redis does not answer the commands left behind are bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from prefixgate.cachetier.redis_clients import connect
from tests.cachetier.cancel_storm import LOST, cancel_storm, serves, settled, unhandled
from tests.cachetier.support import PrivateRedis, TcpProxy, test_prefix

POOL = 4


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    server = PrivateRedis().start()  # its own: the connections it counts are this test's alone
    try:
        yield server
    finally:
        server.stop()


def _info(server: PrivateRedis, field: str) -> int:
    for line in server.cli("info").splitlines():
        if line.startswith(field + ":"):
            return int(line.split(":", 1)[1])
    raise AssertionError(f"no {field} in INFO")


async def test_calls_cancelled_at_random_points_lose_nothing(redis_server: PrivateRedis) -> None:
    client = connect(redis_server.url, max_connections=POOL, timeout=1.0)
    prefix = test_prefix()
    try:
        await serves(client, prefix, POOL)  # every connection of the pool open
        opened = _info(redis_server, "total_connections_received")

        with unhandled() as errors:
            outcomes = await cancel_storm(client, prefix)
            await settled(client)
        assert not errors, errors[:3]

        assert outcomes["cancelled"] + outcomes["timeout"] + outcomes[LOST] > 60, outcomes  # many cut
        assert outcomes[LOST] == 0, f"cancellations lost: {outcomes}"
        await serves(client, prefix, POOL)
        # a command cancelled mid-flight used to cost its connection: a new one for the next call
        assert _info(redis_server, "total_connections_received") - opened <= 1, outcomes  # the cli's
        assert _info(redis_server, "connected_clients") <= POOL + 1  # + the cli asking
    finally:
        await client.aclose()


async def test_while_redis_is_silent_commands_left_behind_are_bounded() -> None:
    proxy = TcpProxy()
    await proxy.start()
    client = connect(proxy.url, max_connections=2, timeout=0.5)
    prefix = test_prefix()
    try:
        await serves(client, prefix, 2)
        proxy.blackhole = True
        fast: list[float] = []
        left_behind: set[asyncio.Task[object]] = set()
        for i in range(40):  # callers that give up after 20 ms, as the index's deadlines do
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(0.02):
                    await client.get(f"{prefix}{i}")
            except TimeoutError:
                pass
            except RedisConnectionError:
                fast.append(time.monotonic() - t0)
            assert len(client.detached.abandoned) <= client.detached.max_abandoned
            left_behind |= client.detached.abandoned
        assert fast, "nothing failed fast while the left-behind commands were at their bound"
        assert max(fast) < 0.015  # at once, not after a deadline
        with unhandled() as errors:
            await settled(client, timeout=5.0)  # they end by the socket timeouts, in errors
            assert left_behind and all(t.done() for t in left_behind)
            left_behind.clear()  # dropped: one whose error nobody took would be logged now
        assert not client.detached.abandoned
        assert not errors, errors[:3]
        proxy.blackhole = False
        await serves(client, prefix, 2)  # serving again once Redis answers
    finally:
        await client.aclose()
        await proxy.stop()
