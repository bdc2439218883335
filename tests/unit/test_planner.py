"""The planner: mode, nodes and reasons from views alone, the same for every policy."""

from __future__ import annotations

import pytest

from prefixgate.gateway.routing import POLICIES, KVFormat, NodeView, parse_policy
from prefixgate.gateway.routing.planner import Plan, RequestView, Rules, plan, queue_wait_s
from prefixgate.gateway.vocab import Mode, Role

FMT = KVFormat("model-a", 64, "fp8_e4m3", "page:layer,kv,head,token,dim", 320)
OTHER_DTYPE = KVFormat("model-a", 64, "bf16", "page:layer,kv,head,token,dim", 640)
OTHER_MODEL = KVFormat("model-b", 64, "fp8_e4m3", "page:layer,kv,head,token,dim", 320)
TPS = 100_000.0


def node(
    node_id: str,
    role: Role = Role.PREFILL,
    *,
    queued: int = 0,
    fmt: KVFormat | None = FMT,
    routable: bool = True,
    streams: int = 0,
) -> NodeView:
    return NodeView(
        node_id,
        outstanding_requests=1 if queued else 0,
        outstanding_tokens=queued,
        prefill_tokens_per_s=TPS,
        attention_coeff_s=0.0,
        role=role,
        kv_format=fmt,
        routable=routable,
        streams=streams,
    )


def request(hits: dict[str, int] | None = None, tokens: int = 8192) -> RequestView:
    return RequestView(tokens, 64, hits or {}, first_block=7)


def cluster(*, p0: int = 0, p1: int = 0) -> list[NodeView]:
    return [node("p0", queued=p0), node("p1", queued=p1), node("d0", Role.DECODE), node("d1", Role.DECODE)]


def test_split_pairs_the_chosen_prefill_node_with_the_least_busy_decode_node() -> None:
    nodes = [node("p0"), node("d0", Role.DECODE, streams=3), node("d1", Role.DECODE, streams=1)]
    p = plan(request(), nodes, parse_policy("prefixgate"))
    assert p.mode.mode == Mode.DISAGGREGATED
    assert p.prefill is not None and p.prefill.node_id == "p0"
    assert p.decode_node == "d1" and p.monolithic is None


def test_pairing_skips_decode_nodes_with_another_kv_format() -> None:
    nodes = [node("p0"), node("d0", Role.DECODE, fmt=OTHER_DTYPE), node("d1", Role.DECODE, streams=9)]
    p = plan(request(), nodes, parse_policy("prefixgate"))
    assert p.mode.mode == Mode.DISAGGREGATED and p.decode_node == "d1"


def test_no_decode_node_accepting_the_pages_falls_back_and_names_the_fields() -> None:
    nodes = [node("p0"), node("d0", Role.DECODE, fmt=OTHER_DTYPE), node("d1", Role.DECODE, fmt=None)]
    p = plan(request(), nodes, parse_policy("prefixgate"))
    assert p.mode.mode == Mode.FALLBACK and p.decode_node is None
    assert "no decode node accepts the prefill node's KV pages" in p.mode.reason
    assert "d0: KV format mismatch: dtype 'fp8_e4m3' != 'bf16', bytes_per_token 320 != 640" in p.mode.reason
    assert "d1: KV format unknown" in p.mode.reason
    # The fallback still knows where to go: a decode node serves the whole request.
    assert p.monolithic is not None and p.monolithic.node_id in ("d0", "d1")


def test_a_prefill_node_of_unknown_format_pairs_with_any_decode_node() -> None:
    nodes = [node("p0", fmt=None), node("d0", Role.DECODE, fmt=OTHER_DTYPE)]
    p = plan(request(), nodes, parse_policy("prefixgate"))
    assert p.mode.mode == Mode.DISAGGREGATED and p.decode_node == "d0"


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("prefix_routing", [True, False])
def test_the_ttft_budget_fallback_fires_under_every_policy(policy: str, prefix_routing: bool) -> None:
    deep = 10_000_000  # 100 s of queued prefill on each node
    rules = Rules(prefix_routing=prefix_routing, ttft_budget_s=30.0)
    p = plan(request({"p0": 10}), cluster(p0=deep, p1=deep), parse_policy(policy), rules)
    assert p.queue_wait_s == pytest.approx(deep / TPS)
    assert p.mode.mode == Mode.FALLBACK
    assert p.mode.reason == "prefill queue wait 100.00s exceeds the TTFT budget 30.00s"
    assert p.monolithic is not None and p.decode_node is None


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_queue_wait_is_the_chosen_nodes_whatever_the_policy(policy: str) -> None:
    nodes = cluster(p0=200_000, p1=50_000)
    p = plan(request(), nodes, parse_policy(policy))
    assert p.prefill is not None and p.prefill.node_id is not None
    chosen = next(v for v in nodes if v.node_id == p.prefill.node_id)
    assert p.queue_wait_s == pytest.approx(queue_wait_s(chosen)) and p.queue_wait_s > 0
    assert p.mode.mode == Mode.DISAGGREGATED


def test_reasons_for_not_splitting() -> None:
    pg = parse_policy("prefixgate")
    off = plan(request(), cluster(), pg, Rules(disaggregation=False))
    assert (off.mode.mode, off.mode.reason) == (Mode.MONOLITHIC, "disaggregation switched off")
    assert off.monolithic is not None and off.decode_node is None
    no_pool = plan(request(), [node("d0", Role.DECODE)], pg)
    assert no_pool.mode.mode == Mode.MONOLITHIC and "no prefill pool configured" in no_pool.mode.reason
    down = [node("p0", routable=False), node("d0", Role.DECODE)]
    p = plan(request(), down, pg)
    assert (p.mode.mode, p.mode.reason) == (Mode.FALLBACK, "no prefill node can take the request")
    assert p.prefill is None and p.queue_wait_s == 0.0
    no_decode = plan(request(), [node("p0"), node("d0", Role.DECODE, routable=False)], pg)
    assert (no_decode.mode.mode, no_decode.mode.reason) == (
        Mode.FALLBACK,
        "no decode node can take the request",
    )


def test_no_capacity_at_all_leaves_nothing_to_route_to() -> None:
    nodes = [node("p0", routable=False), node("d0", Role.DECODE, routable=False)]
    p = plan(request(), nodes, parse_policy("prefixgate"))
    assert p.mode.mode == Mode.FALLBACK
    assert p.prefill is None and p.monolithic is None and p.decode_node is None


def test_monolithic_shortcut_when_the_uncached_part_is_small() -> None:
    nodes = [node("p0"), node("m0", Role.MONOLITHIC), node("d0", Role.DECODE)]
    rules = Rules(min_disagg_tokens=1024)
    p = plan(request({"m0": 120}, tokens=8192), nodes, parse_policy("prefixgate"), rules)
    assert p.mode.mode == Mode.MONOLITHIC and "only 512 uncached tokens" in p.mode.reason
    assert p.monolithic is not None and p.monolithic.node_id == "m0" and p.monolithic.cached_blocks == 120
    long = plan(request({"m0": 10}, tokens=8192), nodes, parse_policy("prefixgate"), rules)
    assert long.mode.mode == Mode.DISAGGREGATED and long.decode_node == "d0"


def test_monolithic_candidates_serve_the_prefill_pools_model_only() -> None:
    nodes = [
        node("p0"),
        node("m0", Role.MONOLITHIC, fmt=OTHER_MODEL),
        node("d0", Role.DECODE),
    ]
    p = plan(request(), nodes, parse_policy("least_loaded"), Rules(disaggregation=False))
    # The monolithic node runs another model: the decode node serves it whole instead.
    assert p.monolithic is not None and p.monolithic.node_id == "d0"


def test_excluded_nodes_are_not_planned_on() -> None:
    p = plan(request(), cluster(), parse_policy("round_robin"), exclude={"p0", "d0"})
    assert p.prefill is not None and p.prefill.node_id == "p1" and p.decode_node == "d1"


def test_the_turn_breaks_ties_and_nothing_else_moves_it() -> None:
    rr = parse_policy("round_robin")
    picks = []
    for turn in range(4):
        p = plan(request(), cluster(), rr, turn=turn)
        assert p == plan(request(), cluster(), rr, turn=turn)  # pure: the same input, the same plan
        assert p.prefill is not None
        picks.append(p.prefill.node_id)
    assert picks == ["p0", "p1", "p0", "p1"]
    pg = parse_policy("prefixgate")
    idle = {plan(request(), cluster(), pg, turn=t).prefill.node_id for t in range(2)}  # type: ignore[union-attr]
    assert idle == {"p0", "p1"}


def test_a_plan_is_a_value() -> None:
    p = plan(request(), cluster(), parse_policy("prefixgate"))
    assert isinstance(p, Plan)
    with pytest.raises(AttributeError):
        p.decode_node = "d9"  # type: ignore[misc]


@pytest.mark.parametrize("policy", ["prefixgate", "longest_prefix"])
def test_a_measured_slow_link_does_not_cost_the_warm_node_its_hit(policy: str) -> None:
    """The node holding the prefix already shipped pages and reports a measured (slow) link; a
    cold node still reports the modelled fast one. The hit decides, not the mix of figures. (Fast,
    time-scaled nodes: recomputing 8K tokens costs 4 ms, shipping them at 29 MB/s 90 ms.)"""

    def prefill_node(node_id: str, link: float) -> NodeView:
        return NodeView(
            node_id,
            prefill_tokens_per_s=2_000_000.0,
            attention_coeff_s=0.0,
            role=Role.PREFILL,
            kv_format=FMT,
            kv_bytes_per_token=320,
            transfer_bytes_per_s=link,
        )

    nodes = [prefill_node("warm", 29e6), prefill_node("cold", 40e9), node("d0", Role.DECODE)]
    p = plan(request({"warm": 8192 // 64 - 1}), nodes, parse_policy(policy))
    assert p.prefill is not None and p.prefill.node_id == "warm", p.prefill.reason if p.prefill else None
