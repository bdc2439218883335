"""The sliding-window limiter, pure, with an injected clock: all or none, an honest
``retry_after``, settling."""

from __future__ import annotations

import pytest

from prefixgate.gateway.scheduling.limit_policy import (
    LimitPolicy,
    Pair,
    parse_tenant_limits,
    refusal_message,
)
from prefixgate.gateway.scheduling.token_limits import Check, Granted, Refused, WindowSet
from tests.limits.cases import CASES, MemoryCounters

T0 = 1_000_000_000_500  # a wall-clock time in ms, half-way through a second


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
async def test_limiter_cases(case: object) -> None:
    await case(MemoryCounters())  # type: ignore[operator]


def test_buckets_per_counter_are_bounded_by_the_window() -> None:
    w = WindowSet()
    for s in range(200):
        assert isinstance(w.reserve([Check("c", 10**9, 1)], T0 + s * 1000), Granted)
        assert len(w.counters["c"]) <= 60
    assert w.used("c", T0 + 199_000) == 60
    assert w.used("c", T0 + 400_000) == 0 and "c" not in w.counters  # idle: gone


def test_tenant_limits_parse_and_refuse_clearly() -> None:
    got = parse_tenant_limits(["acme:tpm=200000", "rpm=600", "beta:rpm=5", "a:b:tpm=1"])
    assert got == {"acme": Pair(200_000, 600), "beta": Pair(-1, 5), "a:b": Pair(1, -1)}
    for bad in (["acme"], ["acme:tpm=x"], ["acme:tpm=1,tpm=2"], [":tpm=1"], ["a:tpm=1", "a:rpm=1"]):
        with pytest.raises(ValueError, match="tenant_limits"):
            parse_tenant_limits(bad)


def test_policy_checks_name_the_setting() -> None:
    policy = LimitPolicy(Pair(1000, 0), Pair(0, 3), {"acme": Pair(200_000, -1)})
    checks = policy.checks("acme", "k1", 50)
    assert [(c.counter, c.limit, c.cost, lim.setting) for c, lim in checks] == [
        ("tpm", 200_000, 50, "tenant_limits"),
        ("k:k1:rpm", 3, 1, "key_requests_per_minute"),
    ]
    assert [c.counter for c, _ in policy.checks("other", "", 50)] == ["tpm"]
    _, lim = checks[0]
    text = refusal_message("acme", "k1", lim, 50, 199_990, 1_200)
    assert text.startswith("tenant acme: 200000 tokens per minute (tenant_limits)")
    assert text.endswith("retry after 2 s")
    keyless = LimitPolicy(overrides={"default": Pair(7, -1)}, keyless=True)
    assert keyless.tenant_limits("")[0].value == 7


def test_refused_names_the_check_that_fits_last() -> None:
    w = WindowSet()
    assert isinstance(w.reserve([Check("a", 10, 10)], T0), Granted)
    assert isinstance(w.reserve([Check("b", 10, 10)], T0 + 5_000), Granted)
    out = w.reserve([Check("a", 10, 1), Check("b", 10, 1)], T0 + 6_000)
    assert out == Refused(1, 10, (T0 // 1000 + 5 + 60) * 1000 - (T0 + 6_000))
