"""The scheduler's verdicts over node views (``gateway.scheduling.scheduler``)."""

from __future__ import annotations

from prefixgate.gateway.routing.base import NodeView
from prefixgate.gateway.scheduling.classes import Schedule
from prefixgate.gateway.scheduling.queue import Entry, QueueLimits
from prefixgate.gateway.scheduling.room import RoomRule
from prefixgate.gateway.scheduling.scheduler import Scheduler, Verdict, prefill_views
from prefixgate.gateway.vocab import Role

RATE = 100_000.0


def busy(tokens: int = 100_000) -> NodeView:
    return NodeView("p0", outstanding_requests=2, outstanding_tokens=tokens, prefill_tokens_per_s=RATE)


IDLE = NodeView("p0", prefill_tokens_per_s=RATE)


def entry(ticket: int, slo_s: float = 0.0, sheddable: bool = False, cost: int = 1000) -> Entry:
    return Entry(ticket, "t", Schedule("c", 0, sheddable, slo_s), cost, cost / RATE, 0.0, 100)


def test_a_request_starts_at_once_when_nothing_waits_and_a_node_has_room() -> None:
    assert Scheduler().arrive(entry(1), [IDLE], 0.0).verdict == Verdict.START


def test_it_waits_when_no_node_has_room_and_leaves_when_one_has() -> None:
    s = Scheduler()
    e = entry(1)
    admit = s.arrive(e, [busy()], 0.0)
    assert admit.verdict == Verdict.WAIT and admit.wait_s == 1.0  # 100K tokens ahead at 100K/s
    assert s.hold(e) == ""
    assert s.take([busy()], 0.1) is None
    assert s.take([IDLE], 0.2) is e and len(s.queue) == 0


def test_a_request_behind_waiting_ones_waits_even_if_a_node_has_room() -> None:
    s = Scheduler()
    s.hold(entry(1))
    assert s.arrive(entry(2), [IDLE], 0.0).verdict == Verdict.WAIT


def test_full_queue_refuses_with_retry_after() -> None:
    s = Scheduler(QueueLimits(max_requests=1))
    s.hold(entry(1))
    admit = s.arrive(entry(2), [busy()], 0.0)
    assert admit.verdict == Verdict.FULL and admit.retry_after_s >= 1.0
    assert "scheduler_queue_requests" in admit.reason


def test_a_sheddable_request_that_would_miss_its_target_is_shed_a_plain_one_is_late() -> None:
    s = Scheduler()
    shed = s.arrive(entry(1, slo_s=0.5, sheddable=True), [busy()], 0.0)
    assert shed.verdict == Verdict.SHED and "500 ms" in shed.reason and shed.retry_after_s >= 1.0
    assert s.arrive(entry(2, slo_s=0.5), [busy()], 0.0).verdict == Verdict.LATE
    assert s.arrive(entry(3, slo_s=2.0, sheddable=True), [busy()], 0.0).verdict == Verdict.WAIT


def test_the_queue_is_off_with_max_requests_0() -> None:
    s = Scheduler(room=RoomRule(max_requests=0))
    assert s.arrive(entry(1), [busy(10**9)], 0.0).verdict == Verdict.START


def test_prefill_views_are_the_prefill_pool_else_whole_serving_nodes() -> None:
    p = NodeView("p", role=Role.PREFILL)
    d = NodeView("d", role=Role.DECODE)
    m = NodeView("m", role=Role.MONOLITHIC)
    assert prefill_views([p, d, m]) == [p]
    assert prefill_views([d, m]) == [m]
    assert prefill_views([d]) == [d]


def test_without_a_routable_node_nothing_waits() -> None:
    s = Scheduler()
    assert s.arrive(entry(1), [], 0.0).verdict == Verdict.START
    s.hold(entry(2))
    assert s.take([], 0.0) is not None  # released, to be refused by the planner


def test_a_full_queue_takes_a_request_of_another_tenant_in_place_of_the_floods_latest() -> None:
    s = Scheduler(QueueLimits(max_requests=2))
    flood = [Entry(i, "a", Schedule(), 1000, 0.01, float(i), 10) for i in (1, 2)]
    for e in flood:
        assert s.hold(e) == ""
    other = Entry(3, "b", Schedule(), 1000, 0.01, 3.0, 10)
    assert s.arrive(other, [busy()], 3.0).verdict == Verdict.WAIT
    assert s.hold(other) == "" and s.displaced == [flood[1]]
    assert s.arrive(Entry(4, "a", Schedule(), 1000, 0.01, 4.0, 10), [busy()], 4.0).verdict == Verdict.FULL
