"""Prefixes routed and still computing (``gateway.routing.inflight``): pure, the caller's clock."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixgate.bench.peers import parse_variant
from prefixgate.gateway.routing import parse_policy
from prefixgate.gateway.routing.base import NodeView, RouteInput
from prefixgate.gateway.routing.inflight import (
    DEFAULT_COUNTED_BLOCKS,
    InflightPrefixes,
    extension,
    merge_hits,
)

A = [11, 12, 13, 14, 15, 16]  # a chain of block hashes (each covers its whole prefix)
B = [11, 12, 23, 24]  # shares two blocks with A


def test_a_routed_chain_counts_for_its_node_until_the_prefill_is_done() -> None:
    t = InflightPrefixes(ttl_s=30.0, grace_s=1.0)
    ticket = t.add("n1", A[:4], now=0.0)
    assert t.hits(A, now=0.1) == {"n1": 4}
    assert t.hits(B, now=0.1) == {"n1": 2}
    assert t.hits([99, 11], now=0.1) == {}  # a leading miss is a miss
    t.done(ticket, now=0.5, served=True)
    assert t.hits(A, now=1.4) == {"n1": 4}  # the grace: the index write is landing
    assert t.hits(A, now=1.6) == {} and len(t) == 0


def test_a_failed_request_releases_its_chain_at_once() -> None:
    t = InflightPrefixes()
    ticket = t.add("n1", A, now=0.0)
    t.add("n2", B, now=0.0)
    t.done(ticket, now=0.2, served=False)
    assert t.hits(A, now=0.2) == {"n2": 2}


def test_shared_blocks_stay_while_any_chain_holds_them() -> None:
    t = InflightPrefixes()
    a = t.add("n1", A, now=0.0)
    t.add("n1", B, now=0.0)
    t.done(a, now=0.1, served=False)
    assert t.hits(A, now=0.1) == {"n1": 2}
    assert t.hits(B, now=0.1) == {"n1": 4}


def test_entries_expire_and_the_table_is_bounded() -> None:
    t = InflightPrefixes(ttl_s=5.0, max_entries=3)
    for i in range(5):
        t.add(f"n{i}", [100 + i], now=float(i) * 0.1)
    assert len(t) == 3 and t.stats.dropped == 2
    assert t.hits([100], now=1.0) == {}  # the oldest went first
    assert t.hits([104], now=1.0) == {"n4": 1}
    assert t.hits([104], now=6.0) == {} and len(t) == 0 and t.stats.expired == 3
    assert InflightPrefixes(ttl_s=0).add("n1", A, now=0.0) == 0  # switched off: holds nothing


def test_merge_takes_the_longer_run_and_extension_says_by_how_much() -> None:
    index = {"n0": 3, "n1": 1}
    inflight = {"n1": 5, "n2": 2}
    assert merge_hits(index, inflight) == {"n0": 3, "n1": 5, "n2": 2}
    assert extension(index, inflight) == 2
    assert extension(index, {"n2": 2}) == 0


def test_a_follow_up_goes_where_its_prefix_is_being_computed() -> None:
    """The case the index alone gets wrong: the prefix is queued on n1, which has a request ahead,
    so without the routed chain the follow-up goes to the idle n0 and computes it again."""
    policy = parse_policy("prefixgate")
    nodes = [NodeView("n0"), NodeView("n1", outstanding_requests=1, outstanding_tokens=8192)]
    t = InflightPrefixes()
    chain = list(range(1, 129))  # 8,192 tokens
    t.add("n1", chain, now=0.0)
    follow_up = [*chain, 500, 501]
    blind = policy.choose(RouteInput(130 * 64, 64, {}), nodes)
    assert blind.node_id == "n0"
    seen = merge_hits({}, t.hits(follow_up, now=0.1))
    decided = policy.choose(RouteInput(130 * 64, 64, seen), nodes)
    assert decided.node_id == "n1" and decided.cached_blocks == 128


def test_bench_peers_variant_specs() -> None:
    assert parse_variant("index-only:inflight_prefixes=false,load-factor=1.5") == (
        "index-only",
        {"PREFIXGATE_INFLIGHT_PREFIXES": "false", "PREFIXGATE_LOAD_FACTOR": "1.5"},
    )
    for bad in ("index-only", "x:novalue", ":a=b", "x:=b"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_forget_drops_the_chains_holding_evicted_blocks_of_that_node_only() -> None:
    t = InflightPrefixes()
    t.add("a", [1, 2, 3], 0.0)
    t.add("a", [7, 8], 0.0)
    t.add("b", [1, 2, 3], 0.0)
    assert t.forget("a", {3}) == 1
    assert t.hits([1, 2, 3], 0.1) == {"b": 3}
    assert t.hits([7, 8], 0.1) == {"a": 2}
    assert t.forget("a") == 1
    assert t.hits([7, 8], 0.1) == {}
    assert len(t) == 1


def _chain(*labels: int) -> list[int]:
    """Chained hashes: block ``i``'s hash names the whole prefix up to it (as block hashes do)."""
    out, h = [], 0
    for label in labels:
        h = hash((h, label)) & 0xFFFFFFFFFFFF
        out.append(h)
    return out


@given(
    st.lists(
        st.tuples(st.sampled_from(["n1", "n2"]), st.lists(st.integers(0, 2), min_size=1, max_size=12)),
        max_size=8,
    ),
    st.lists(st.integers(0, 2), min_size=1, max_size=12),
)
def test_a_node_covers_the_longest_run_any_of_its_chains_shares_with_the_prompt(
    routed: list[tuple[str, list[int]]], prompt: list[int]
) -> None:
    t = InflightPrefixes()
    for node, labels in routed:
        t.add(node, _chain(*labels), now=0.0)
    query = _chain(*prompt)
    expected: dict[str, int] = {}
    for node, labels in routed:  # by brute force: leading blocks equal, position by position
        chain = _chain(*labels)
        k = 0
        while k < min(len(chain), len(query)) and chain[k] == query[k]:
            k += 1
        if k > expected.get(node, 0):
            expected[node] = k
    assert t.hits(query, now=0.1) == expected


# the default, and depths short enough for these few-block chains to pass them (the longer path)
@given(
    st.sampled_from([DEFAULT_COUNTED_BLOCKS, 1, 2, 3, 256]),
    st.lists(
        st.tuples(
            st.sampled_from(["n1", "n2"]),
            st.lists(st.integers(0, 2), min_size=1, max_size=10),
            st.booleans(),  # let go of again before the lookup
        ),
        max_size=10,
    ),
    st.lists(st.integers(0, 2), min_size=1, max_size=10),
)
def test_lookups_agree_with_brute_force_as_chains_come_and_go(
    counted: int, routed: list[tuple[str, list[int], bool]], prompt: list[int]
) -> None:
    """However few blocks are counted, chains held twice, and chains let go of again: the
    lookups stay exact."""
    t = InflightPrefixes(counted_blocks=counted)
    for node, labels, gone in routed:
        ticket = t.add(node, _chain(*labels), now=0.0)
        if gone:
            t.done(ticket, now=0.0, served=False)
    query = _chain(*prompt)
    expected: dict[str, int] = {}
    for node, labels, gone in routed:
        chain = _chain(*labels)
        k = 0
        while not gone and k < min(len(chain), len(query)) and chain[k] == query[k]:
            k += 1
        if k > expected.get(node, 0):
            expected[node] = k
    assert t.hits(query, now=0.1) == expected
    for ticket in list(t._entries):
        t.done(ticket, now=0.1, served=False)
    assert t.hits(query, now=0.1) == {} and not t._held  # nothing left behind


def test_many_chains_sharing_a_system_prompt_each_count_for_their_node() -> None:
    system = list(range(8))
    t = InflightPrefixes(counted_blocks=4)  # the system prompt's blocks past the counted ones
    tickets = [t.add(f"n{i % 3}", _chain(*system, 100 + i, 7), now=0.0) for i in range(300)]
    assert t.hits(_chain(*system, 999), now=0.1) == {"n0": 8, "n1": 8, "n2": 8}
    assert t.hits(_chain(*system, 101, 7), now=0.1) == {"n0": 8, "n1": 10, "n2": 8}
    for ticket in tickets[1:]:
        t.done(ticket, now=0.1, served=False)
    assert t.hits(_chain(*system, 101, 7), now=0.1) == {"n0": 8}  # only request 0's chain is left
    assert t.hits(_chain(*system, 100, 7), now=0.1) == {"n0": 10}


# the default, and 4: chains of up to nine blocks pass it and take the longer path
@pytest.mark.parametrize("counted", [DEFAULT_COUNTED_BLOCKS, 4, 256])
def test_chains_let_go_of_in_any_order_leave_exact_and_bounded_counts(counted: int) -> None:
    """Blocks counted out pile up beside those counted in until they are counted anew: lookups
    stay exact throughout (past the counted blocks too) and the counters never hold much more
    than the live chains' counted blocks."""
    rng = random.Random(7)
    t = InflightPrefixes(counted_blocks=counted)
    labels = [(1, 2, 3, i, *range(i % 5)) for i in range(60)]
    chains = {t.add("n1", _chain(*x), now=0.0): _chain(*x) for x in labels}
    order = list(chains)
    rng.shuffle(order)
    for ticket in order:
        t.done(ticket, now=0.0, served=False)
        del chains[ticket]
        for probe in (_chain(1, 2, 3, 17, 0, 1), _chain(1, 2, 9), _chain(1, 2, 3, 59, 0, 1, 2, 3)):
            best = max((_run(c, probe) for c in chains.values()), default=0)
            assert t.hits(probe, now=0.0) == ({"n1": best} if best else {})
        held = t._held.get("n1")
        assert (held is None) == (not chains)
        if held is not None:
            live = sum(min(len(c), counted) for c in chains.values())
            assert len(held.into) <= 2 * live + counted + 1


def _run(chain: list[int], prompt: list[int]) -> int:
    k = 0
    while k < min(len(chain), len(prompt)) and chain[k] == prompt[k]:
        k += 1
    return k


def test_a_long_chain_is_held_and_released_whole() -> None:
    t = InflightPrefixes()
    chain = _chain(*range(2000))
    ticket = t.add("n1", chain, now=0.0)
    assert t.hits(chain, now=0.1) == {"n1": 2000}
    assert t.hits(chain[:1500] + _chain(*range(9, 509)), now=0.1) == {"n1": 1500}
    t.done(ticket, now=0.2, served=False)
    assert t.hits(chain, now=0.2) == {} and len(t) == 0
