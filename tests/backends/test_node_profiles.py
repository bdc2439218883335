"""Cost model: calibration to the S5000 reference figure and agreement with the router."""

from __future__ import annotations

import math

import pytest

from prefixgate.backends.profiles import (
    ASTAR,
    INSTANT,
    MAX_RATE,
    REFERENCE_PREFILL_TOKENS_PER_S,
    S5000,
    get_profile,
    prefill_throughput,
)
from prefixgate.gateway.routing.base import NodeView, prefill_seconds


def test_s5000_reproduces_reference_figure_at_64k() -> None:
    assert prefill_throughput(S5000, 65_536) == pytest.approx(REFERENCE_PREFILL_TOKENS_PER_S, rel=1e-9)
    assert REFERENCE_PREFILL_TOKENS_PER_S == 95_920.5
    # 30 % of the 64K prefill is attention.
    attention = S5000.attention_coeff_s * 65_536 * 65_536 / 2
    assert attention / S5000.prefill_seconds(65_536, 0) == pytest.approx(0.30)


def test_attention_makes_long_context_slower() -> None:
    short = prefill_throughput(S5000, 1024)
    long = prefill_throughput(S5000, 131_072)
    assert short > REFERENCE_PREFILL_TOKENS_PER_S > long
    # New tokens after a long cached prefix cost more than the same tokens at the start.
    assert S5000.prefill_seconds(1024, 60_000) > S5000.prefill_seconds(1024, 0)


@pytest.mark.parametrize("time_scale", [1.0, 0.05, 0.01])
@pytest.mark.parametrize(("new", "ctx"), [(1, 0), (1000, 0), (4096, 60_000), (65_536, 0), (100, 128_000)])
def test_router_formula_agrees_with_reported_profile(time_scale: float, new: int, ctx: int) -> None:
    eff = S5000.effective(time_scale)
    view = NodeView(
        "n", prefill_tokens_per_s=eff.prefill_tokens_per_s, attention_coeff_s=eff.attention_coeff_s
    )
    expected = S5000.prefill_seconds(new, ctx) * time_scale
    assert prefill_seconds(view, new, ctx) == pytest.approx(expected, rel=1e-9)
    assert eff.prefill_seconds(new, ctx) == pytest.approx(expected, rel=1e-9)


def test_decode_time_between_tokens_grows_with_context() -> None:
    assert ASTAR.decode_step_seconds(65_536) > ASTAR.decode_step_seconds(0) > 0
    assert 0.01 < ASTAR.decode_step_seconds(65_536) < 0.05


def test_instant_costs_nothing_and_reports_finite_rates() -> None:
    assert INSTANT.prefill_seconds(100_000, 100_000) == 0
    assert INSTANT.decode_step_seconds(100_000) == 0
    eff = INSTANT.effective(1.0)
    assert eff.prefill_tokens_per_s == MAX_RATE and math.isfinite(eff.transfer_bytes_per_s)
    assert S5000.effective(0).prefill_tokens_per_s == MAX_RATE


def test_profile_lookup() -> None:
    assert get_profile(None, "prefill") is S5000
    assert get_profile("", "decode") is ASTAR
    assert get_profile("instant").prefill_seconds(10, 0) == 0
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("h100")


def test_one_s5000_for_nodes_router_and_simulator() -> None:
    from prefixgate.backends.kvpages import REFERENCE_MODEL
    from prefixgate.bench.profile import S5000 as SIM_S5000
    from prefixgate.gateway.routing import costmodel

    assert S5000 is costmodel.S5000 and SIM_S5000.hardware is costmodel.S5000
    # The simulator charges the link for the KV the nodes' reference model makes.
    assert SIM_S5000.kv_bytes_per_token == REFERENCE_MODEL.kv_bytes_per_token == 163_840
    assert SIM_S5000.transfer_s(1000) == pytest.approx(1000 * 163_840 / 40e9)
    # A view with no figures of its own estimates with the same hardware.
    view = NodeView("n")
    assert prefill_seconds(view, 4096, 60_000) == pytest.approx(
        S5000.prefill_seconds(4096, 60_000), rel=1e-12
    )
    assert view.transfer_bytes_per_s == S5000.transfer_bytes_per_s
