"""The virtual-time simulator: accounting, queueing, caching, fallback, and policy ordering."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from prefixgate.bench.profile import S5000
from prefixgate.bench.simulator import SimConfig, Simulator, global_lru_bound, simulate
from prefixgate.bench.textgen import span_hashes
from prefixgate.bench.traces import load_mooncake
from prefixgate.bench.workloads import Request, WorkloadOptions
from prefixgate.gateway.routing import POLICIES, PrefixGatePolicy, parse_policy

BS = 64
ROOT = 12345


def req(i: int, t: float, spans: list[tuple[int, int]], session: int = -1) -> Request:
    tokens = sum(n for _, n in spans)
    return Request(i, t, tokens, tuple(span_hashes(spans, BS, ROOT)), 100, session, tuple(spans))


def sessions_workload(
    n_sessions: int = 40, turns: int = 5, gap_s: float = 0.05, seed: int = 1
) -> list[Request]:
    """Chat sessions behind one shared system prompt; each turn extends the previous prompt."""
    rng = random.Random(seed)
    events: list[tuple[float, int, list[tuple[int, int]]]] = []
    seg = 1000
    for s in range(n_sessions):
        t = rng.uniform(0, 2.0)
        spans: list[tuple[int, int]] = [(1, 1024)]  # the shared system prompt
        for _ in range(turns):
            spans = [*spans, (seg, rng.randint(500, 4000))]
            seg += 1
            events.append((t, s, list(spans)))
            t += gap_s * rng.uniform(5, 20)
    events.sort(key=lambda e: e[0])
    return [req(i, t, spans, s) for i, (t, s, spans) in enumerate(events)]


def test_every_request_is_accounted_and_time_advances() -> None:
    reqs = sessions_workload()
    cfg = SimConfig(prefill_nodes=3, capacity_blocks=30_000, block_size=BS)
    for name in POLICIES:
        sim = Simulator(parse_policy(name), cfg)
        s = sim.run(reqs)
        assert s.requests == len(reqs) == len(sim.outcomes)
        assert sorted(o.index for o in sim.outcomes) == list(range(len(reqs)))
        assert sum(s.requests_per_node.values()) + s.fallbacks == len(reqs)
        assert s.makespan_s > reqs[-1].arrival_s - reqs[0].arrival_s
        assert sim.now >= reqs[-1].arrival_s
        assert 0.0 <= s.hit_rate < 1.0 and 0.0 < s.utilisation <= 1.0 + 1e-9
        assert s.ttft_p50_s <= s.ttft_p95_s <= s.ttft_p99_s
        for o in sim.outcomes:
            expect = o.queue_s + o.prefill_s + o.transfer_s + (S5000.first_token_s if o.node else 0.0)
            if o.node:
                assert o.ttft_s == pytest.approx(expect)
                assert o.queue_s >= -1e-9 and o.prefill_s >= 0
        assert s.prefill_tokens == sum(r.prompt_tokens for r in reqs) - sum(
            o.cached_tokens for o in sim.outcomes
        )


def test_prefix_aware_routing_beats_round_robin_on_shared_prefixes() -> None:
    reqs = sessions_workload()
    cfg = SimConfig(prefill_nodes=4, capacity_blocks=40_000, block_size=BS)
    rr = simulate(reqs, parse_policy("round_robin"), cfg)
    lp = simulate(reqs, parse_policy("longest_prefix"), cfg)
    pg = simulate(reqs, parse_policy("prefixgate"), cfg)
    bound = global_lru_bound(reqs, cfg.capacity_blocks, BS)
    assert rr.hit_rate <= pg.hit_rate
    assert pg.hit_rate >= 0.9 * bound["hit_rate"]
    assert pg.prefill_tokens < rr.prefill_tokens
    # Longest prefix piles every session on the node holding the system prompt; the bound does not.
    assert max(lp.requests_per_node.values()) == len(reqs)
    assert pg.imbalance < lp.imbalance and pg.ttft_p99_s < lp.ttft_p99_s


def test_fifo_queue_and_cache_hit_in_virtual_time() -> None:
    a = req(0, 0.0, [(1, 6400)])
    b = req(1, 0.0, [(2, 6400)])
    c = req(2, 10.0, [(1, 6400), (3, 640)])  # extends a, long after both finished
    sim = Simulator(
        parse_policy("round_robin"), SimConfig(prefill_nodes=1, capacity_blocks=10_000, block_size=BS)
    )
    sim.run([a, b, c])
    oa, ob, oc = sim.outcomes
    work = S5000.prefill_s(6400, 0)
    assert oa.queue_s == 0.0 and oa.prefill_s == pytest.approx(work)
    assert ob.queue_s == pytest.approx(work)  # waited for a: one prefill at a time
    assert oc.cached_tokens == 6400 and oc.prefill_s == pytest.approx(S5000.prefill_s(640, 6400))
    assert sim.nodes[0].busy_s == pytest.approx(2 * work + oc.prefill_s)


def test_processor_sharing_with_concurrency() -> None:
    a, b = req(0, 0.0, [(1, 6400)]), req(1, 0.0, [(2, 6400)])
    cfg = SimConfig(prefill_nodes=1, capacity_blocks=10_000, block_size=BS, concurrency=2)
    sim = Simulator(parse_policy("round_robin"), cfg)
    s = sim.run([a, b])
    work = S5000.prefill_s(6400, 0)
    assert [o.queue_s for o in sim.outcomes] == [0.0, 0.0]
    assert all(o.prefill_s == pytest.approx(2 * work) for o in sim.outcomes)
    assert s.busy_s_per_node["p0"] == pytest.approx(2 * work)


def test_fallback_when_the_queue_exceeds_the_budget() -> None:
    reqs = [req(i, 0.0, [(i + 10, 64_000)]) for i in range(6)]
    cfg = SimConfig(prefill_nodes=2, capacity_blocks=10_000, block_size=BS, ttft_budget_s=0.5)
    sim = Simulator(parse_policy("least_loaded"), cfg)
    s = sim.run(reqs)
    assert s.fallbacks == 2  # two fit at once with no queue; two more queue < 0.5 s; the rest would not
    falls = [o for o in sim.outcomes if o.route == "fallback"]
    assert all(o.node == "" and o.cached_tokens == 0 and o.queue_s == 0.0 for o in falls)
    assert sum(s.requests_per_node.values()) == 4


def test_global_lru_bound() -> None:
    a, b = req(0, 0.0, [(1, 640)]), req(1, 1.0, [(1, 640), (2, 64)])
    bound = global_lru_bound([a, b], 100, BS)
    assert bound["hit_rate"] == pytest.approx(640 / (640 + 704))
    assert bound["unbounded_hit_rate"] == bound["hit_rate"]
    # One block of room: the root block stays (it is the most recently touched).
    assert global_lru_bound([a, b], 1, BS)["hit_rate"] == pytest.approx(64 / (640 + 704))


def test_parse_policy() -> None:
    p = parse_policy("prefixgate:affinity=5,token_factor=2")
    assert isinstance(p, PrefixGatePolicy) and p.affinity == 5.0 and p.token_factor == 2.0
    with pytest.raises(ValueError):
        parse_policy("nope")


def test_mooncake_slice_in_the_simulator(mooncake_trace: Path) -> None:
    w = load_mooncake(mooncake_trace, WorkloadOptions(block_size=512, limit=500, time_scale=10.0))
    cfg = SimConfig(prefill_nodes=4, capacity_blocks=20_000, block_size=512)
    res = {name: simulate(w.requests, parse_policy(name), cfg) for name in POLICIES}
    bound = global_lru_bound(w.requests, cfg.capacity_blocks, 512)
    for s in res.values():
        assert s.requests == 500 and sum(s.requests_per_node.values()) + s.fallbacks == 500
    assert res["prefixgate"].hit_rate >= res["round_robin"].hit_rate
    assert res["prefixgate"].hit_rate >= 0.9 * bound["hit_rate"]
    assert res["prefixgate"].imbalance <= 1.5
    # Every request shares block 0: hashing on it puts all traffic on one node.
    assert max(res["consistent_hash"].requests_per_node.values()) + res["consistent_hash"].fallbacks == 500


def test_a_follow_up_joins_its_prefix_still_computing_only_with_inflight_prefixes() -> None:
    """b extends a and arrives while a is computing on the busier node: the index alone cannot
    know a's blocks yet and b computes them again elsewhere; the routed chain sends b behind a."""
    filler = req(0, 0.0, [(7, 6400)])  # keeps one node busy so the tie-break does not hide it
    a = req(1, 0.0, [(1, 64_000)])
    b = req(2, 0.01, [(1, 64_000), (2, 640)])
    cfg = SimConfig(prefill_nodes=2, capacity_blocks=20_000, block_size=BS)
    on = Simulator(parse_policy("prefixgate"), cfg)
    on.run([filler, a, b])
    off = Simulator(parse_policy("prefixgate"), replace(cfg, inflight=False))
    off.run([filler, a, b])
    assert on.outcomes[2].node == on.outcomes[1].node and on.outcomes[2].cached_tokens == 64_000
    assert off.outcomes[2].node != off.outcomes[1].node and off.outcomes[2].cached_tokens == 0
    assert on.inflight.stats.added == on.inflight.stats.done == 3  # each released when its prefill ended
    # A policy without a load bound does not follow in-flight prefixes (it would pile onto them).
    lp = Simulator(parse_policy("longest_prefix"), cfg)
    assert lp.inflight.ttl_s == 0
