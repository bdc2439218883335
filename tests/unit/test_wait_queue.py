"""The gateway-held queue's order and bounds (``gateway.scheduling.queue``)."""

from __future__ import annotations

import itertools

import pytest

from prefixgate.gateway.scheduling.classes import (
    DEFAULT_CLASS,
    Schedule,
    class_table,
    parse_class,
    schedule_of,
)
from prefixgate.gateway.scheduling.queue import Entry, QueueLimits, WaitQueue

_tickets = itertools.count(1)


def entry(
    tenant: str = "a",
    cost: int = 1000,
    at: float = 0.0,
    priority: int = 0,
    slo_s: float = 0.0,
    size: int = 0,
    predicted_s: float | None = None,
) -> Entry:
    pred = cost / 100_000 if predicted_s is None else predicted_s
    return Entry(next(_tickets), tenant, Schedule("c", priority, False, slo_s), cost, pred, at, size)


def drain(q: WaitQueue, now: float = 0.0) -> list[Entry]:
    out = []
    while (e := q.pop(now)) is not None:
        out.append(e)
    return out


def test_equal_requests_of_one_tenant_leave_first_come_first_served() -> None:
    q = WaitQueue()
    es = [entry(at=i * 0.001) for i in range(5)]
    for e in es:
        q.push(e)
    assert drain(q) == es


def test_a_short_request_overtakes_long_ones_that_arrived_shortly_before() -> None:
    q = WaitQueue()
    long1, long2 = entry(cost=12_000, at=0.0), entry(cost=12_000, at=0.01)
    short = entry(cost=200, at=0.02)
    for e in (long1, long2, short):
        q.push(e)
    assert drain(q) == [short, long1, long2]


def test_deferral_is_bounded_nothing_starves_behind_later_short_requests() -> None:
    lim = QueueLimits(max_defer_s=1.0)
    q = WaitQueue(lim)
    long = entry(cost=1_000_000, at=0.0)  # 10 s predicted: deferred the 1 s bound only
    q.push(long)
    later = [entry(cost=100, at=0.5 + i * 0.1) for i in range(10)]  # 0.5 .. 1.4 s
    for e in later:
        q.push(e)
    order = drain(q)
    before = order[: order.index(long)]
    assert all(e.arrival_s < 1.0 for e in before) and len(before) == 5


def test_a_deadline_pulls_a_request_forward_to_its_latest_start() -> None:
    q = WaitQueue(QueueLimits(max_defer_s=10.0))
    plain = entry(cost=50_000, at=0.0)  # rank 0 + 8 x 0.5 = 4 s
    due = entry(cost=50_000, at=1.0, slo_s=1.0)  # due at 2 s: must start by 1.5 s
    q.push(plain)
    q.push(due)
    assert drain(q) == [due, plain]


def test_a_lower_priority_value_goes_first() -> None:
    q = WaitQueue()
    low, high = entry(priority=5, at=0.0), entry(priority=-1, at=1.0)
    q.push(low)
    q.push(high)
    assert drain(q, now=1.0) == [high, low]


def test_a_starving_band_is_promoted_after_promote_after_s() -> None:
    q = WaitQueue(QueueLimits(promote_after_s=2.0))
    low = entry(priority=5, at=0.0)
    q.push(low)
    for i in range(3):
        q.push(entry(priority=0, at=1.0 + i))
    assert q.pop(now=1.5) is not low  # waited 1.5 s: the higher band goes
    assert q.pop(now=2.5) is low  # waited 2.5 s: promoted


def test_fair_share_a_flooding_tenant_cannot_push_back_another() -> None:
    q = WaitQueue(QueueLimits(quantum_tokens=1000))
    flood = [entry("a", cost=1000, at=i * 0.001) for i in range(50)]
    for e in flood:
        q.push(e)
    b = [entry("b", cost=1000, at=1.0 + i) for i in range(3)]
    for e in b:
        q.push(e)
    order = drain(q, now=5.0)
    # b had nothing waiting: its turn starts at once, then it alternates with a's
    assert [order.index(e) for e in b] == [0, 2, 4]


def test_fair_share_counts_tokens_not_requests() -> None:
    q = WaitQueue(QueueLimits(quantum_tokens=1000))
    for i in range(20):
        q.push(entry("big", cost=4000, at=i * 0.001))
        q.push(entry("small", cost=1000, at=i * 0.001))
    order = drain(q)[:20]
    big = sum(e.cost_tokens for e in order if e.tenant == "big")
    small = sum(e.cost_tokens for e in order if e.tenant == "small")
    assert 0.6 < big / small < 1.6


def test_removed_entries_give_their_counts_back_and_never_leave() -> None:
    q = WaitQueue()
    es = [entry(size=10, at=i) for i in range(3)]
    for e in es:
        q.push(e)
    assert q.remove(es[1].ticket) is es[1]
    assert q.remove(es[1].ticket) is None
    assert len(q) == 2 and q.bytes == 20
    assert drain(q) == [es[0], es[2]]
    assert len(q) == 0 and q.bytes == 0 and q.depths(0.0) == []


def test_bounds_count_bytes_and_wait() -> None:
    q = WaitQueue(QueueLimits(max_requests=2, max_bytes=100, max_wait_s=5.0))
    q.push(entry(size=60, at=0.0))
    assert "scheduler_queue_bytes" in q.full(50)
    q.push(entry(size=10, at=1.0))
    assert "scheduler_queue_requests" in q.full(0)
    assert q.next_expiry() == 5.0
    gone = q.expired(5.5)
    assert [e.arrival_s for e in gone] == [0.0] and len(q) == 1 and q.full(0) == ""


def test_ahead_tokens_counts_higher_bands_and_fair_shares() -> None:
    q = WaitQueue()
    q.push(entry("x", cost=5000, priority=-1))
    for _ in range(10):
        q.push(entry("a", cost=1000))
    q.push(entry("b", cost=500))
    # a new request of b (1000 tokens): band -1 whole, b's own 500, a's share up to 1500
    assert q.ahead_tokens("b", 0, 1000) == 5000 + 500 + 1500


def test_depths_per_band_and_tenant() -> None:
    q = WaitQueue()
    q.push(entry("a", cost=100, at=1.0))
    q.push(entry("a", cost=200, at=2.0, priority=3))
    d = {(x.priority, x.tenant): x for x in q.depths(4.0)}
    assert d[(0, "a")].tokens == 100 and d[(0, "a")].oldest_s == 3.0
    assert d[(3, "a")].requests == 1


def test_classes_parse_and_resolve() -> None:
    table = class_table(["interactive:priority=-1;ttft_slo_ms=2000", "batch:priority=10;sheddable"])
    assert table[DEFAULT_CLASS].priority == 0
    s = schedule_of(table, "batch", None, None)
    assert (s.priority, s.sheddable, s.ttft_slo_s) == (10, True, 0.0)
    s = schedule_of(table, "interactive", 4, 500.0)
    assert (s.priority, s.ttft_slo_s) == (4, 0.5)
    assert schedule_of(table, None, None, None).class_name == DEFAULT_CLASS


@pytest.mark.parametrize(
    "bad", ["", "a b:priority=1", "x:priority=one", "x:color=red", "x:ttft_slo_ms=-1", "x:sheddable=maybe"]
)
def test_bad_class_entries_are_refused_with_the_reason(bad: str) -> None:
    with pytest.raises(ValueError, match="priority class"):
        parse_class(bad)


def test_a_class_configured_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        class_table(["a", "a:priority=1"])


def test_a_full_queue_makes_room_from_the_tenant_holding_the_most() -> None:
    q = WaitQueue(QueueLimits(max_requests=4))
    flood = [entry("a", at=i) for i in range(4)]
    for e in flood:
        q.push(e)
    assert q.full(0)
    assert q.displace("b", 0, dry_run=True) == [flood[-1]] and len(q) == 4  # a dry run takes nothing
    assert q.displace("b", 0) == [flood[-1]]  # a's latest arrival
    q.push(entry("b", at=9))
    assert q.displace("a", 0) == []  # a holds the most: it makes no room for itself
    assert q.full(0)
    assert q.displace("c", 0) == [flood[-2]]
    q.push(entry("c", at=11))
    # a (2) and b (1) and c (1): b would hold 2 as a does: nothing taken
    assert q.displace("b", 0) == []
