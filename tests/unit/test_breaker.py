"""Circuit breaker transitions."""

from __future__ import annotations

from prefixgate.gateway.cluster.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


def test_opens_after_consecutive_failures_and_recovers_through_half_open() -> None:
    b = CircuitBreaker(threshold=3, base_cooldown_s=1.0)
    for t in range(2):
        b.on_failure(float(t))
    assert b.state == CLOSED and b.allows(2.0)
    b.on_failure(2.0)
    assert b.state == OPEN and not b.allows(2.5)
    assert b.allows(3.1) and b.state == HALF_OPEN
    b.on_dispatch()
    assert not b.allows(3.2)  # one trial at a time
    b.on_success()
    assert b.state == CLOSED and b.allows(3.3)


def test_failed_trial_doubles_the_cooldown() -> None:
    b = CircuitBreaker(threshold=1, base_cooldown_s=1.0, max_cooldown_s=3.0)
    b.on_failure(0.0)
    assert b.allows(1.0)
    b.on_dispatch()
    b.on_failure(1.0)
    assert b.state == OPEN and b.cooldown_s == 2.0 and not b.allows(2.5)
    assert b.allows(3.0)
    b.on_dispatch()
    b.on_failure(3.0)
    assert b.cooldown_s == 3.0  # capped


def test_probe_and_trip() -> None:
    b = CircuitBreaker()
    b.trip(0.0)
    assert b.state == OPEN and not b.allows(0.1)
    b.on_probe_ok(0.2)
    assert b.state == HALF_OPEN and b.allows(0.2)
    b.on_success()
    assert b.failures == 0 and b.state == CLOSED
