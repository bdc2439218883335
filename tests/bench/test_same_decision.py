"""The simulator and the gateway make the same decision on the same views, for every policy.

The gateway's views come from nodes that reported their stats (``tests.planning``); the very same
views are handed to the simulator's router. A sequence of decisions is compared, so the
tie-break turn must move alike too, and the loads cover the TTFT-budget fallback.
"""

from __future__ import annotations

import pytest

from prefixgate.bench.simulator import SimConfig, Simulator
from prefixgate.bench.workloads import Request
from prefixgate.gateway.routing import POLICIES, parse_policy
from prefixgate.gateway.vocab import Mode
from tests.planning import BS, gateway, prepared, report

NODES = {"p0": "prefill", "p1": "prefill", "p2": "prefill", "d0": "decode", "d1": "decode"}
# (queued prefill tokens per prefill node, leading blocks each holds): idle, a shared prefix,
# uneven queues, and queues past the 30 s budget at 100K tok/s.
SCENES: list[tuple[dict[str, int], dict[str, int]]] = [
    ({}, {}),
    ({}, {}),
    ({}, {"p1": 40, "p2": 8}),
    ({"p0": 400_000, "p1": 50_000, "p2": 900_000}, {"p0": 60, "p2": 60}),
    ({"p0": 400_000, "p1": 50_000, "p2": 900_000}, {}),
    ({"p0": 4_000_000, "p1": 3_100_000, "p2": 9_000_000}, {"p1": 30}),
    ({"p0": 4_000_000, "p1": 3_100_000, "p2": 9_000_000}, {}),
    ({}, {"p0": 63}),
]


@pytest.mark.parametrize("policy", sorted(POLICIES))
async def test_simulator_and_gateway_decide_alike(policy: str) -> None:
    sim = Simulator(parse_policy(policy), SimConfig(prefill_nodes=3, block_size=BS, ttft_budget_s=30.0))
    modes = set()
    async with gateway(policy, NODES, ttft_budget_s=30.0) as pipe:
        prep = prepared(pipe, tokens=64 * 64)
        req = Request(0, 0.0, prep.prompt_tokens, tuple(prep.hashes), 16)
        for queued, hits in SCENES:
            for node in pipe.pool.nodes.values():
                if node.role == "prefill":
                    report(node, node.id, queued_tokens=queued.get(node.id, 0))
            views = [n.view() for n in pipe.pool.nodes.values()]
            live = pipe.decide(prep, hits)
            simulated = sim.plan(req, hits, views)
            assert simulated == live
            modes.add(live.mode.mode)
    assert modes == {Mode.DISAGGREGATED, Mode.FALLBACK}
