"""The gateway's own decision (``Pipeline.decide``/``preview``) over nodes that reported their stats."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.routing import POLICIES
from prefixgate.gateway.vocab import Mode
from tests.planning import gateway, prepared, report

SPLIT = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
DEEP = 10_000_000  # 100 s of prefill queued on every node at 100K tok/s


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("prefix_routing", [True, False])
async def test_the_ttft_budget_fallback_fires_under_every_policy(policy: str, prefix_routing: bool) -> None:
    async with gateway(policy, SPLIT, queued_tokens=DEEP, ttft_budget_s=30.0) as pipe:
        pipe.switches.prefix_routing = prefix_routing
        prep = prepared(pipe)
        plan = pipe.decide(prep, {"p0": 4})
        assert plan.mode.mode == Mode.FALLBACK, plan.mode
        assert plan.mode.reason == "prefill queue wait 100.00s exceeds the TTFT budget 30.00s"
        assert plan.monolithic is not None and plan.monolithic.node_id in ("d0", "d1")
        assert pipe.preview(prep, {"p0": 4}).mode.mode == Mode.FALLBACK


@pytest.mark.parametrize("policy", sorted(POLICIES))
async def test_a_short_queue_is_served_split(policy: str) -> None:
    async with gateway(policy, SPLIT, queued_tokens=100_000, ttft_budget_s=30.0) as pipe:
        plan = pipe.decide(prepared(pipe), {})
        assert plan.mode.mode == Mode.DISAGGREGATED and plan.decode_node in ("d0", "d1")
        assert plan.queue_wait_s == pytest.approx(1.0)


async def test_round_robin_takes_turns_over_the_prefill_nodes() -> None:
    async with gateway("round_robin", SPLIT) as pipe:
        prep = prepared(pipe)
        picks = [pipe.decide(prep, {}).prefill for _ in range(4)]
        assert [d.node_id if d else None for d in picks] == ["p0", "p1", "p0", "p1"]


async def test_preview_changes_nothing_and_shows_the_next_decision() -> None:
    for policy in ("round_robin", "prefixgate"):
        async with gateway(policy, SPLIT) as pipe:
            prep = prepared(pipe)
            pipe.decide(prep, {})
            turn = pipe.turns[prep.model]
            previews = [pipe.preview(prep, {}) for _ in range(3)]
            assert pipe.turns[prep.model] == turn and previews[0] == previews[1] == previews[2]
            assert pipe.decide(prep, {}) == previews[0]
            assert pipe.turns[prep.model] == turn + 1


async def test_decode_nodes_are_paired_by_kv_format() -> None:
    async with gateway("prefixgate", {"p0": "prefill", "d0": "decode", "d1": "decode"}) as pipe:
        by_id: Callable[[str], Node | None] = pipe.pool.by_id
        d0 = by_id("d0")
        assert d0 is not None
        report(d0, "d0", dtype="bf16")
        plan = pipe.decide(prepared(pipe), {})
        assert plan.mode.mode == Mode.DISAGGREGATED and plan.decode_node == "d1"
        d1 = by_id("d1")
        assert d1 is not None
        report(d1, "d1", dtype="f32")
        plan = pipe.decide(prepared(pipe), {})
        assert plan.mode.mode == Mode.FALLBACK
        assert "d0: KV format mismatch: dtype 'fp8_e4m3' != 'bf16'" in plan.mode.reason
        assert "d1: KV format mismatch: dtype 'fp8_e4m3' != 'f32'" in plan.mode.reason


async def test_the_settings_policy_spec_reaches_the_pipeline() -> None:
    async with gateway("prefixgate:affinity=5,token_factor=2", SPLIT, load_factor=1.5) as pipe:
        assert (pipe.policy.affinity, pipe.policy.token_factor, pipe.policy.load_factor) == (5.0, 2.0, 1.5)  # type: ignore[attr-defined]
