"""The first-token deadline follows the prediction for the request on its node: a hung node
costs a short prefill seconds, a long prefill keeps the time it needs, a node of unknown speed
gets ``first_token_timeout_s``."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.config import Settings
from prefixgate.gateway.nodeclient import CostProfile
from prefixgate.gateway.nodeclient.fake import FakeNodeClient, Script, Tokens, fake_status
from prefixgate.gateway.nodeclient.nominal import NOMINAL_PROFILE
from prefixgate.gateway.routing import costmodel
from prefixgate.gateway.routing.deadline import Rule, Speed, Work, limit_s, predicted_s
from prefixgate.gateway.vocab import Mode
from tests.unit.seam_support import harness

pytestmark = pytest.mark.timeout(10)

S = Settings()
OK = Tokens()
DEFAULT = Rule(S.first_token_deadline_margin, S.first_token_deadline_floor_s, S.first_token_timeout_s)
S5000 = Speed(costmodel.S5000.prefill_tokens_per_s, costmodel.S5000.attention_coeff_s)


def test_the_limit_is_the_prediction_with_its_margin_between_the_floor_and_the_cap() -> None:
    short = Work(queued_tokens=0, uncached_tokens=1024, cached_tokens=0)
    assert limit_s(S5000, short, DEFAULT, left_s=300) == DEFAULT.floor_s  # 1K: the floor, not 60 s
    # 128K behind two more of them on a node 20x slower than the reference: ~75 s predicted
    slow = Speed(S5000.tokens_per_s / 20, S5000.attention_coeff_s * 20)
    long = Work(queued_tokens=2 * 131_072, uncached_tokens=131_072, cached_tokens=0, transfer_s=0.5)
    p = predicted_s(slow, long)
    assert 60 < p < 120
    assert limit_s(slow, long, dataclasses.replace(DEFAULT, cap_s=0), left_s=300) == pytest.approx(
        min(300, DEFAULT.margin * p)
    )
    assert limit_s(slow, long, DEFAULT, left_s=300) == DEFAULT.cap_s  # never beyond the cap
    assert limit_s(slow, long, DEFAULT, left_s=7.5) == 7.5  # nor the request deadline
    # the cached part is not computed again; the transfer and the queue count
    assert predicted_s(S5000, Work(0, 64, 131_000)) < predicted_s(S5000, Work(0, 131_064, 0)) / 10
    assert predicted_s(S5000, Work(10_000, 64, 0, 1.0)) > 1.0 + 10_000 / S5000.tokens_per_s


def test_an_unknown_speed_or_a_margin_of_zero_leaves_the_fixed_timeout() -> None:
    w = Work(0, 1024, 0)
    assert limit_s(None, w, DEFAULT, left_s=300) == DEFAULT.cap_s
    assert limit_s(S5000, w, dataclasses.replace(DEFAULT, margin=0), left_s=300) == DEFAULT.cap_s
    assert limit_s(None, w, dataclasses.replace(DEFAULT, cap_s=0), left_s=42) == 42


def test_a_node_speed_is_its_profile_slowed_by_what_it_lags_else_the_rate_the_gateway_timed() -> None:
    n = Node("prefill", "p1", FakeNodeClient("p1"))
    assert n.prefill_speed is None  # not polled yet
    n.observe_rate(32, 1.0)  # too short to time: overhead, not speed
    assert n.prefill_speed is None
    n.observe_rate(2000, 1.0)
    assert n.prefill_speed == Speed(2000.0)
    n.status = dataclasses.replace(
        fake_status("p1", "prefill"), profile=CostProfile(prefill_tokens_per_s=10_000, attention_coeff_s=1e-9)
    )
    n.slowness = 0.5  # faster than it claims: a deadline still takes the claim
    assert n.prefill_speed == Speed(10_000, 1e-9)
    n.slowness = 4.0
    assert n.prefill_speed == Speed(2_500, 4e-9)


def test_a_prefill_cut_at_its_deadline_lengthens_the_next_ones_and_a_nominal_figure_is_no_speed() -> None:
    n = Node("prefill", "p1", FakeNodeClient("p1"))
    n.status = dataclasses.replace(
        fake_status("p1", "prefill"), profile=CostProfile(prefill_tokens_per_s=10_000)
    )
    rule = dataclasses.replace(DEFAULT, floor_s=0)
    before = limit_s(n.prefill_speed, Work(0, 4000, 0), rule, 300)
    n.ran_past()
    n.ran_past()
    assert limit_s(n.prefill_speed, Work(0, 4000, 0), rule, 300) == pytest.approx(4 * before)
    assert n.speed_factor == 1.0  # routing does not see it
    n.in_time(4000, 0.4)
    assert limit_s(n.prefill_speed, Work(0, 4000, 0), rule, 300) == pytest.approx(2 * before)
    n.status = dataclasses.replace(n.status, profile=NOMINAL_PROFILE)  # an HTTP worker states none
    n.measured_tokens_per_s = 0.0
    assert n.prefill_speed is None


def _profiled(address: str, tokens_per_s: float, queued: int = 0, prefill: Script = OK) -> FakeNodeClient:
    """A prefill fake stating its speed."""
    status = fake_status(address, "prefill", queued=queued)
    status = dataclasses.replace(status, profile=CostProfile(prefill_tokens_per_s=tokens_per_s))
    return FakeNodeClient(address, status=status, prefill=prefill)


async def test_a_hung_prefill_is_given_up_on_after_its_predicted_time_not_the_60_s_timeout() -> None:
    p1 = _profiled("p1", 100_000, prefill=[Tokens(delay_s=30.0), Tokens()])
    p2 = _profiled("p2", 100_000, queued=2)  # p1 first
    # a 0.3 s floor keeps the test short (the default 2 s would be its whole wait)
    async with harness(
        ("prefill", p1), ("prefill", p2), ("decode", FakeNodeClient("d1")), first_token_deadline_floor_s=0.3
    ) as h:
        assert h.pipeline.settings.first_token_timeout_s == 60  # the default
        t0 = asyncio.get_running_loop().time()
        ex = await h.pipeline.execute(h.prep())
        assert asyncio.get_running_loop().time() - t0 < 2.0
        assert ex.route == Mode.DISAGGREGATED and ex.prefill_node is h.node("p2") and ex.attempts == 2
        hung = h.node("p1")
        assert hung.breaker.failures == 1 and "prefill on p1: timeout" in hung.last_error
        assert h.node("d1").breaker.failures == 0
        await ex.close()


async def test_a_prefill_predicted_long_is_left_the_time_it_needs() -> None:
    # 400 tokens at 400 tokens/s: 1 s predicted, 3 s allowed; it takes 1.2 s
    p1 = _profiled("p1", 400, prefill=Tokens(delay_s=1.2))
    # a 0.3 s floor: without the prediction the prefill would be cut
    async with harness(
        ("prefill", p1), ("decode", FakeNodeClient("d1")), first_token_deadline_floor_s=0.3
    ) as h:
        ex = await h.pipeline.execute(h.prep(prompt_tokens=400))
        assert ex.attempts == 1 and h.node("p1").breaker.failures == 0
        await ex.close()
