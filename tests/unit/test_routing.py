"""Routing policies and the disaggregation decision, as pure functions."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixgate.gateway.config import load_settings
from prefixgate.gateway.routing import NodeView, PrefixGatePolicy, RouteInput, parse_policy, policy_parameters
from prefixgate.gateway.routing.mode import choose_mode
from prefixgate.gateway.vocab import Mode


def views(*loads: int) -> list[NodeView]:
    return [
        NodeView(f"n{i}", outstanding_requests=ld, outstanding_tokens=ld * 1000) for i, ld in enumerate(loads)
    ]


def test_prefixgate_prefers_the_node_holding_the_long_prefix() -> None:
    p = parse_policy("prefixgate")
    d = p.choose(RouteInput(8192, 64, {"n1": 120}), views(0, 0))
    assert d.node_id == "n1" and d.cached_blocks == 120
    assert d.chosen is not None and d.chosen.ttft_s < max(e.ttft_s for e in d.estimates)


def test_prefixgate_bounds_load_when_everyone_shares_a_prefix() -> None:
    p = parse_policy("prefixgate")
    loads = {"n0": 0, "n1": 0}
    for _ in range(10):  # ten concurrent requests sharing only block 0
        nodes = [NodeView(n, outstanding_requests=ld, outstanding_tokens=ld * 500) for n, ld in loads.items()]
        d = p.choose(RouteInput(600, 64, {"n0": 2}), nodes)
        assert d.node_id is not None
        loads[d.node_id] += 1
    assert min(loads.values()) >= 3, loads


def test_longest_prefix_without_bound_collapses_onto_one_node() -> None:
    p = parse_policy("longest_prefix")
    picks = {p.choose(RouteInput(600, 64, {"n0": 2}), views(i, 0)).node_id for i in range(10)}
    assert picks == {"n0"}


def test_round_robin_and_least_loaded_and_hash() -> None:
    rr = parse_policy("round_robin")
    assert [rr.choose(RouteInput(10, 64, {}, turn=t), views(0, 0, 0)).node_id for t in range(4)] == [
        "n0",
        "n1",
        "n2",
        "n0",
    ]
    assert parse_policy("least_loaded").choose(RouteInput(10, 64, {}), views(3, 1, 2)).node_id == "n1"
    ch = parse_policy("consistent_hash")
    a = ch.choose(RouteInput(10, 64, {}, first_block=42), views(0, 0, 0)).node_id
    assert all(
        ch.choose(RouteInput(10, 64, {}, first_block=42), views(5, 0, 1)).node_id == a for _ in range(3)
    )
    assert parse_policy("prefixgate").choose(RouteInput(10, 64, {}), []).node_id is None


def test_mode_decision() -> None:
    kw = dict(
        prefill_routable=2, decode_routable=4, min_disagg_tokens=256, queue_wait_s=0.1, ttft_budget_s=5.0
    )
    assert choose_mode(disaggregation=True, uncached_tokens=5000, **kw).mode == Mode.DISAGGREGATED  # type: ignore[arg-type]
    assert choose_mode(disaggregation=True, uncached_tokens=100, **kw).mode == Mode.MONOLITHIC  # type: ignore[arg-type]
    assert choose_mode(disaggregation=False, uncached_tokens=5000, **kw).mode == Mode.MONOLITHIC  # type: ignore[arg-type]
    kw["prefill_routable"] = 0
    assert choose_mode(disaggregation=True, uncached_tokens=5000, **kw).mode == Mode.FALLBACK  # type: ignore[arg-type]
    kw["prefill_routable"], kw["queue_wait_s"] = 2, 9.0
    assert choose_mode(disaggregation=True, uncached_tokens=5000, **kw).mode == Mode.FALLBACK  # type: ignore[arg-type]


def test_a_slow_node_gets_a_share_matching_its_speed() -> None:
    p = parse_policy("prefixgate")
    speeds = {"fast": 100_000.0, "slow": 10_000.0}
    loads = {"fast": 0, "slow": 0}
    for _ in range(20):
        nodes = [
            NodeView(n, outstanding_requests=ld, outstanding_tokens=ld * 4000, prefill_tokens_per_s=speeds[n])
            for n, ld in loads.items()
        ]
        d = p.choose(RouteInput(4000, 64, {}), nodes)
        assert d.node_id is not None
        loads[d.node_id] += 1
    assert loads["slow"] <= 3, loads


def test_no_prefill_pool_is_monolithic_not_fallback() -> None:
    def mode(configured: bool) -> str:
        return choose_mode(
            disaggregation=True,
            prefill_configured=configured,
            prefill_routable=0,
            decode_routable=4,
            uncached_tokens=9000,
            min_disagg_tokens=0,
            queue_wait_s=0.0,
            ttft_budget_s=5.0,
        ).mode

    assert mode(False) == Mode.MONOLITHIC
    assert mode(True) == Mode.FALLBACK


def test_policy_specs_set_parameters() -> None:
    p = parse_policy("prefixgate:affinity=5, token_factor=2")
    assert isinstance(p, PrefixGatePolicy)
    assert (p.affinity, p.token_factor, p.load_factor) == (5.0, 2.0, 1.25)
    # Defaults fill what the spec leaves out, for the policies that take them.
    with_default = parse_policy("prefixgate:affinity=5", {"load_factor": 1.5})
    assert isinstance(with_default, PrefixGatePolicy) and with_default.load_factor == 1.5
    spec_wins = parse_policy("prefixgate:load_factor=2", {"load_factor": 1.5})
    assert isinstance(spec_wins, PrefixGatePolicy) and spec_wins.load_factor == 2.0
    assert parse_policy("round_robin", {"load_factor": 1.5}).name == "round_robin"
    assert policy_parameters("prefixgate") == {
        "load_factor": 1.25,
        "token_factor": 1.5,
        "min_headroom": 2,
        "affinity": 20.0,
    }
    assert policy_parameters("least_loaded") == {}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown policy 'nope'; choose from consistent_hash, least_loaded, longest_prefix"),
        ("prefixgate:affinty=5", "policy 'prefixgate' has no parameter 'affinty' (it takes affinity, "),
        (
            "round_robin:load_factor=2",
            "policy 'round_robin' has no parameter 'load_factor' (it takes no para",
        ),
        ("prefixgate:affinity=high", "policy 'prefixgate': affinity must be a number, got 'high'"),
        ("prefixgate:affinity", "policy 'prefixgate': affinity must be a number, got ''"),
        ("prefixgate:affinity=nan", "policy 'prefixgate': affinity must be a number, got 'nan'"),
        ("prefixgate:load_factor=0.5", "policy 'prefixgate:load_factor=0.5': load_factor and token_factor"),
    ],
)
def test_bad_policy_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_policy(spec)
    assert str(err.value).startswith(message), str(err.value)


def test_gateway_settings_take_the_same_specs(tmp_path: Path) -> None:
    s = load_settings(None, {}, environ={"PREFIXGATE_POLICY": "prefixgate:affinity=5,token_factor=2"})
    assert s.policy == "prefixgate:affinity=5,token_factor=2"
    cfg = tmp_path / "gw.toml"
    cfg.write_text('policy = "longest_prefix"\n')
    assert load_settings(cfg, {}, environ={}).policy == "longest_prefix"
    with pytest.raises(ValueError, match="setting 'policy': policy 'prefixgate' has no parameter 'x'"):
        load_settings(None, {"policy": "prefixgate:x=1"}, environ={})
    with pytest.raises(ValueError, match="setting 'policy': unknown policy 'fastest'"):
        load_settings(None, {}, environ={"PREFIXGATE_POLICY": "fastest"})


def test_the_command_line_refuses_a_bad_policy_spec(capsys: pytest.CaptureFixture[str]) -> None:
    from prefixgate.cli import main

    assert main(["gateway", "--policy", "prefixgate:affinty=5", "--decode", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "prefixgate gateway: setting 'policy': policy 'prefixgate' has no parameter 'affinty'" in err
