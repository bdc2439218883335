"""Sliding-window rate limits: tokens or requests per minute, checked and reserved together.

A counter is its last 60 seconds in 1-second buckets (at most 60 per counter): its use at time
``t`` is the sum of the buckets of the seconds ``floor(t) - 59 .. floor(t)``. A request names
every counter it counts against (tenant tokens, tenant requests, key tokens, key requests) and
``WindowSet.reserve`` adds its cost to all of them or to none: a request refused by one limit
takes nothing from the others.

A refusal says when the same reservation would fit: the oldest buckets leave the window one
second at a time, and ``retry_after`` is the time until enough of them have left for every
counter (exact while nothing else is reserved meanwhile). A cost above a limit itself never
fits, and says so (``retry_after`` None).

Tokens are reserved before the answer is known (the prompt plus the most the request may
generate) and settled afterwards: ``settle`` moves the difference to or from the bucket the
reservation went into, while that bucket is still in the window.

Pure: times are milliseconds passed by the caller (wall clock, so replicas sharing counters
agree on the buckets); the Redis store's script (``gateway.state.lua``) computes the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

WINDOW_S = 60
BUCKET_MS = 1000


@dataclass(frozen=True, slots=True)
class Check:
    """One counter a request counts against: its id, its limit per window, the cost."""

    counter: str
    limit: int
    cost: int


@dataclass(frozen=True, slots=True)
class Granted:
    """Reserved on every counter, in the bucket of second ``bucket``; ``used`` after it."""

    bucket: int
    used: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Refused:
    """Not reserved: ``index`` is the check that refused (the one that fits last);
    ``retry_after_ms`` None when its cost is above its limit and never fits."""

    index: int
    used: int
    retry_after_ms: int | None


Outcome = Granted | Refused


def bucket_of(now_ms: int) -> int:
    return now_ms // BUCKET_MS


def live(buckets: Mapping[int, int], now_ms: int) -> dict[int, int]:
    """The buckets still in the window at ``now_ms``."""
    first = bucket_of(now_ms) - WINDOW_S + 1
    return {b: v for b, v in buckets.items() if b >= first}


def wait_ms(buckets: Mapping[int, int], limit: int, cost: int, now_ms: int) -> int | None:
    """Milliseconds until ``cost`` fits under ``limit`` as the buckets leave the window (0: it
    fits now; None: never, the cost is above the limit)."""
    if cost > limit:
        return None
    used = sum(buckets.values())
    if used + cost <= limit:
        return 0
    for b in sorted(buckets):
        used -= buckets[b]
        if used + cost <= limit:
            return (b + WINDOW_S) * BUCKET_MS - now_ms
    return None  # not reached: with every bucket gone the cost fits


def decide(windows: Sequence[Mapping[int, int]], checks: Sequence[Check], now_ms: int) -> Outcome:
    """All or nothing over ``checks`` against their live buckets ``windows``, nothing changed."""
    worst: Refused | None = None
    for i, (w, c) in enumerate(zip(windows, checks, strict=True)):
        wait = wait_ms(w, c.limit, c.cost, now_ms)
        if wait == 0:
            continue
        used = sum(w.values())
        if wait is None:
            return Refused(i, used, None)
        if worst is None or worst.retry_after_ms is None or wait > worst.retry_after_ms:
            worst = Refused(i, used, wait)
    if worst is not None:
        return worst
    after = tuple(sum(w.values()) + c.cost for w, c in zip(windows, checks, strict=True))
    return Granted(bucket_of(now_ms), after)


@dataclass(slots=True)
class WindowSet:
    """Counters in one process (the embedded store), each bounded to ``WINDOW_S`` buckets."""

    counters: dict[str, dict[int, int]] = field(default_factory=dict)

    def _live(self, counter: str, now_ms: int) -> dict[int, int]:
        held = self.counters.get(counter)
        if held is None:
            return {}
        kept = live(held, now_ms)
        if kept:
            self.counters[counter] = kept
        else:
            del self.counters[counter]  # idle counters vanish
        return kept

    def reserve(self, checks: Sequence[Check], now_ms: int) -> Outcome:
        windows = [self._live(c.counter, now_ms) for c in checks]
        out = decide(windows, checks, now_ms)
        if isinstance(out, Granted):
            for c in checks:
                w = self.counters.setdefault(c.counter, {})
                w[out.bucket] = w.get(out.bucket, 0) + c.cost
        return out

    def settle(self, adjustments: Iterable[tuple[str, int]], bucket: int, now_ms: int) -> None:
        """Add ``delta`` (negative: given back) to each counter's bucket ``bucket``, if that
        bucket is still in the window; a bucket never goes below 0."""
        for counter, delta in adjustments:
            w = self._live(counter, now_ms)
            if bucket in w and delta:
                w[bucket] = max(0, w[bucket] + delta)

    def used(self, counter: str, now_ms: int) -> int:
        return sum(self._live(counter, now_ms).values())
