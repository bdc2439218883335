"""Cases every rate-limit store must pass, the same for the pure limiter, the embedded store and
Redis: each takes ``Counters`` (reserve, settle, used) over one tenant."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from prefixgate.gateway.scheduling.token_limits import Check, Granted, Outcome, Refused, WindowSet

T0 = 1_000_000_000_500


class Counters(Protocol):
    async def reserve(self, checks: Sequence[Check], now_ms: int) -> Outcome: ...
    async def settle(self, deltas: Sequence[tuple[str, int]], bucket: int, now_ms: int) -> None: ...
    async def used(self, counters: Sequence[str], now_ms: int) -> list[int]: ...


class MemoryCounters:
    """The pure limiter itself."""

    def __init__(self) -> None:
        self.w = WindowSet()

    async def reserve(self, checks: Sequence[Check], now_ms: int) -> Outcome:
        return self.w.reserve(checks, now_ms)

    async def settle(self, deltas: Sequence[tuple[str, int]], bucket: int, now_ms: int) -> None:
        self.w.settle(deltas, bucket, now_ms)

    async def used(self, counters: Sequence[str], now_ms: int) -> list[int]:
        return [self.w.used(c, now_ms) for c in counters]


async def retry_after_is_honest(c: Counters) -> None:
    """At now + retry_after the same reservation is granted; a millisecond before, refused."""
    for i in range(3):  # 30, 30, 30 tokens at 0 s, 10 s, 20 s of a 100-token limit
        assert isinstance(await c.reserve([Check("tpm", 100, 30)], T0 + i * 10_000), Granted)
    now = T0 + 25_000
    out = await c.reserve([Check("tpm", 100, 50)], now)
    assert isinstance(out, Refused) and out.used == 90 and out.retry_after_ms is not None
    # 50 fits once the first two buckets are gone (90 - 30 - 30 + 50 <= 100): the second leaves
    # at its second + 60
    assert out.retry_after_ms == (T0 // 1000 + 10 + 60) * 1000 - now
    at = now + out.retry_after_ms
    assert isinstance(await c.reserve([Check("tpm", 100, 50)], at - 1), Refused)
    assert isinstance(await c.reserve([Check("tpm", 100, 50)], at), Granted)
    assert await c.used(["tpm"], at) == [80]


async def all_or_none(c: Counters) -> None:
    """A request refused by one counter takes nothing from the others."""
    assert isinstance(await c.reserve([Check("rpm", 2, 1)], T0), Granted)
    assert isinstance(await c.reserve([Check("rpm", 2, 1)], T0), Granted)
    out = await c.reserve([Check("tpm", 1000, 10), Check("rpm", 2, 1), Check("k:x:tpm", 1000, 10)], T0 + 1)
    assert isinstance(out, Refused) and out.index == 1 and out.used == 2
    assert await c.used(["tpm", "rpm", "k:x:tpm"], T0 + 2) == [0, 2, 0]
    ok = await c.reserve([Check("tpm", 1000, 10), Check("k:x:tpm", 1000, 10)], T0 + 3)
    assert isinstance(ok, Granted) and ok.used == (10, 10)


async def above_the_limit_never_fits(c: Counters) -> None:
    out = await c.reserve([Check("tpm", 100, 101)], T0)
    assert isinstance(out, Refused) and out.retry_after_ms is None
    assert await c.used(["tpm"], T0) == [0]


async def settle_gives_back(c: Counters) -> None:
    """Reserved prompt + max_tokens, used less: the difference is free again at once."""
    g = await c.reserve([Check("tpm", 100, 80), Check("k:x:tpm", 100, 80)], T0)
    assert isinstance(g, Granted)
    assert isinstance(await c.reserve([Check("tpm", 100, 30)], T0 + 1_000), Refused)
    await c.settle([("tpm", -60), ("k:x:tpm", -60)], g.bucket, T0 + 2_000)
    assert await c.used(["tpm", "k:x:tpm"], T0 + 2_000) == [20, 20]
    assert isinstance(await c.reserve([Check("tpm", 100, 30)], T0 + 2_000), Granted)
    await c.settle([("tpm", -500)], g.bucket, T0 + 3_000)  # never below 0
    assert await c.used(["tpm"], T0 + 3_000) == [30]
    await c.settle([("tpm", 40)], g.bucket, T0 + 61_000)  # its bucket has left: nothing to do
    assert await c.used(["tpm"], T0 + 61_000) == [30]


async def the_window_slides(c: Counters) -> None:
    assert isinstance(await c.reserve([Check("tpm", 100, 100)], T0), Granted)
    edge = (T0 // 1000 + 60) * 1000
    assert await c.used(["tpm"], edge - 1) == [100]
    assert await c.used(["tpm"], edge) == [0]
    assert isinstance(await c.reserve([Check("tpm", 100, 100)], edge), Granted)


CASES: list[Callable[[Counters], Awaitable[None]]] = [
    retry_after_is_honest,
    all_or_none,
    above_the_limit_never_fits,
    settle_gives_back,
    the_window_slides,
]
