"""Pin quotas: a tenant's pinned blocks per node and in total, the longest pin, expiry."""

from __future__ import annotations

import pytest

from prefixgate.gateway.state.quotas import PinLedger, PinLimits
from prefixgate.openai.exceptions import InvalidRequest, QuotaExceeded

LIMITS = PinLimits(blocks_per_node=100, node_share=0.25, blocks=150, max_seconds=60)


def blocks(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_a_tenant_cannot_pin_most_of_a_node() -> None:
    ledger = PinLedger(LIMITS)
    with pytest.raises(QuotaExceeded) as e:
        ledger.reserve("a", {"p1": 512}, blocks(0, 494), 3600 / 60, now=0)
    assert e.value.code == "pin_quota_exceeded" and "pin_quota_blocks_per_node=100" in e.value.message
    assert ledger.held("a", now=0) == {}  # nothing recorded
    assert e.value.retry_after is None  # too big for the quota itself: retrying never helps
    ledger.reserve("a", {"p1": 512}, blocks(0, 100), 30, now=0)
    assert ledger.held("a", now=1) == {"p1": 100}


def test_the_node_share_bounds_small_pools() -> None:
    ledger = PinLedger(LIMITS)
    with pytest.raises(QuotaExceeded) as e:
        ledger.reserve("a", {"small": 200}, blocks(0, 60), 30, now=0)  # 0.25 * 200 = 50
    assert "pin_quota_node_share=0.25 of 200 blocks" in e.value.message
    ledger.reserve("a", {"small": 200}, blocks(0, 50), 30, now=0)


def test_the_total_spans_nodes_and_tenants_are_independent() -> None:
    ledger = PinLedger(LIMITS)
    ledger.reserve("a", {"p1": 0}, blocks(0, 100), 30, now=0)
    with pytest.raises(QuotaExceeded) as e:
        ledger.reserve("a", {"p2": 0}, blocks(1000, 60), 30, now=0)
    assert "pin_quota_blocks" in e.value.message and "160" in e.value.message
    ledger.reserve("a", {"p2": 0}, blocks(1000, 50), 30, now=0)
    ledger.reserve("b", {"p1": 0, "p2": 0}, blocks(5000, 75), 30, now=0)  # b has its own quota
    assert ledger.held("a", now=0) == {"p1": 100, "p2": 50}
    assert ledger.held("b", now=0) == {"p1": 75, "p2": 75}


def test_re_pinning_counts_a_block_once_and_extends_it() -> None:
    ledger = PinLedger(LIMITS)
    for t in range(5):
        ledger.reserve("a", {"p1": 0}, blocks(0, 80), 30, now=t)
    assert ledger.held("a", now=33) == {"p1": 80}  # the last pin (t=4) runs until 34
    ledger.reserve("a", {"p1": 0}, blocks(40, 60), 30, now=33)  # 40 new blocks: 100 in all
    assert ledger.held("a", now=33) == {"p1": 100}


def test_expired_pins_give_their_quota_back() -> None:
    ledger = PinLedger(LIMITS)
    ledger.reserve("a", {"p1": 0}, blocks(0, 100), 10, now=0)
    with pytest.raises(QuotaExceeded) as e:
        ledger.reserve("a", {"p1": 0}, blocks(500, 1), 10, now=4)
    assert e.value.retry_after == 6  # when the held pins expire
    ledger.reserve("a", {"p1": 0}, blocks(500, 100), 10, now=10.0)
    assert ledger.held("a", now=10.0) == {"p1": 100}
    assert ledger.held("a", now=20.0) == {}


def test_a_pin_that_failed_on_a_node_is_given_back_there_only() -> None:
    ledger = PinLedger(LIMITS)
    ledger.reserve("a", {"p1": 0}, blocks(0, 10), 50, now=0)
    grant = ledger.reserve("a", {"p1": 0, "p2": 0}, blocks(0, 20), 30, now=5)
    grant.cancel("p2")
    assert ledger.held("a", now=6) == {"p1": 20}
    grant.cancel("p1")  # p1 back to its first pin: 10 blocks until 50
    assert ledger.held("a", now=40) == {"p1": 10}


def test_the_longest_pin_is_bounded_and_named() -> None:
    ledger = PinLedger(LIMITS)
    with pytest.raises(InvalidRequest) as e:
        ledger.reserve("a", {"p1": 0}, blocks(0, 1), 7 * 24 * 3600, now=0)
    assert e.value.param == "pin_seconds" and "pin_max_seconds" in e.value.message
    assert not ledger.reserve("a", {"p1": 0}, blocks(0, 1), 0, now=0).before  # no pin, nothing held
