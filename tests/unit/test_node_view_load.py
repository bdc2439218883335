"""A node's load as the policy sees it: our own work counted locally, the status adding only others'."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from prefixgate.gateway.cluster.nodes import Node, NodePool
from prefixgate.gateway.nodeclient import CostProfile
from prefixgate.gateway.nodeclient.fake import FakeNodeClient, fake_status
from prefixgate.gateway.routing.base import NodeView
from prefixgate.gateway.routing.planner import decode_candidates

pytestmark = pytest.mark.timeout(10)


def _view(node: Node) -> NodeView:
    """The node's view, whose queued tokens the shortcut the deadline reads agrees with."""
    v = node.view()
    assert node.outstanding_tokens() == v.outstanding_tokens
    return v


async def test_our_requests_done_since_the_poll_are_not_load_and_others_work_is() -> None:
    busy = replace(fake_status("m1", "monolithic"), running_requests=3, queued_tokens=5000)
    more = replace(busy, running_requests=5, queued_tokens=9000)
    client = FakeNodeClient("m1", status=[busy, more])
    pool = NodePool(connect={"m1": client}.__getitem__, probe_timeout_s=0.2, poll=False)
    try:
        node = pool.add("monolithic", "m1")
        node.local_tokens = 300  # before any status: ours alone
        assert _view(node).outstanding_tokens == 300
        # At the poll: one request of ours in prefill (5,000 tokens), two decoding.
        node.local_requests, node.local_tokens, node.active_streams = 1, 5000, 2
        assert await pool.refresh(node)
        v = _view(node)
        assert (v.outstanding_requests, v.outstanding_tokens) == (1, 5000)  # ours, counted once
        # All three finished after the poll: the node is idle, not 3 requests / 5,000 tokens busy.
        node.local_requests, node.local_tokens, node.active_streams = 0, 0, 0
        v = _view(node)
        assert (v.outstanding_requests, v.outstanding_tokens) == (0, 0)
        # Next poll: 2 more requests and 4,000 more tokens than ours (none now) came from elsewhere.
        node.local_requests, node.local_tokens = 0, 0
        node.active_streams = 3
        assert await pool.refresh(node)
        v = _view(node)
        assert (v.outstanding_requests, v.outstanding_tokens) == (2, 9000)
        node.local_requests, node.local_tokens = 1, 700  # one of ours sent since: counted locally
        v = _view(node)
        assert (v.outstanding_requests, v.outstanding_tokens) == (3, 9700)
    finally:
        await pool.close()


async def test_a_status_counting_less_than_ours_adds_no_one_elses_work() -> None:
    """A status taken before all of our prompt reached the node's queue says less than we sent:
    the rest is not negative work of other gateways."""
    early = replace(fake_status("m1", "monolithic"), running_requests=1, queued_tokens=3000)
    client = FakeNodeClient("m1", status=[early])
    pool = NodePool(connect={"m1": client}.__getitem__, probe_timeout_s=0.2, poll=False)
    try:
        node = pool.add("monolithic", "m1")
        node.local_requests, node.local_tokens = 1, 8000
        assert await pool.refresh(node)
        assert _view(node).outstanding_tokens == 8000
    finally:
        await pool.close()


async def test_a_request_load_is_counted_while_it_runs_and_released_however_it_ends() -> None:
    client = FakeNodeClient("m1", status=[fake_status("m1", "monolithic")])
    pool = NodePool(connect={"m1": client}.__getitem__, probe_timeout_s=0.2, poll=False)
    try:
        node = pool.add("monolithic", "m1")
        assert await pool.refresh(node)
        with node.load(700), node.load(300):
            v = _view(node)
            assert (v.outstanding_requests, v.outstanding_tokens) == (2, 1000)
        with pytest.raises(RuntimeError), node.load(500):
            raise RuntimeError("the attempt failed")
        v = _view(node)
        assert (v.outstanding_requests, v.outstanding_tokens) == (0, 0)
    finally:
        await pool.close()


async def test_a_decode_node_awaiting_its_breakers_trial_goes_first_among_idle_peers() -> None:
    """Taken in id order, a node back from an open breaker would get its one trial only once its
    peers are busy: under light traffic it would stay out of rotation."""
    clients = {a: FakeNodeClient(a, status=[fake_status(a, "decode")]) for a in ("d1", "d2")}
    pool = NodePool(connect=clients.__getitem__, probe_timeout_s=0.2, poll=False)
    try:
        d1, d2 = pool.add("decode", "d1"), pool.add("decode", "d2")
        for n in (d1, d2):
            assert await pool.refresh(n)
        assert [v.node_id for v in decode_candidates([d1.view(), d2.view()])] == ["d1", "d2"]
        d2.breaker.trip(time.monotonic() - 2 * d2.breaker.cooldown_s)  # opened, its cooldown over
        views = [d1.view(), d2.view()]
        assert [v.trial for v in views] == [False, True]
        assert [v.node_id for v in decode_candidates(views)] == ["d2", "d1"]
        d2.breaker.on_dispatch()  # the trial is out: d2 is not routable until it settles
        assert [v.node_id for v in decode_candidates([d1.view(), d2.view()])] == ["d1"]
        d2.breaker.on_success()
        assert [v.trial for v in (d1.view(), d2.view())] == [False, False]
        # A busier node awaiting its trial still comes after an idle one.
        d1.breaker.trip(time.monotonic() - 2 * d1.breaker.cooldown_s)
        d1.active_streams = 1
        assert [v.node_id for v in decode_candidates([d1.view(), d2.view()])] == ["d2", "d1"]
    finally:
        await pool.close()


async def test_a_node_stating_no_speed_is_weighed_by_the_rate_measured() -> None:
    """An SMG worker states no prefill speed: a slow one would keep its share of the traffic."""
    st = replace(fake_status("p1", "prefill"), profile=CostProfile(name="sglang"))
    pool = NodePool(
        connect={"p1": FakeNodeClient("p1", status=[st])}.__getitem__, probe_timeout_s=0.2, poll=False
    )
    try:
        node = pool.add("prefill", "p1")
        assert await pool.refresh(node)
        assert node.view().prefill_tokens_per_s == 1e9  # not measured yet: tried like any other
        node.in_time(4000, 0.5)
        assert node.view().prefill_tokens_per_s == pytest.approx(8000)
        stated = replace(st, profile=CostProfile(name="ours", prefill_tokens_per_s=50_000))
        node.status = stated
        assert node.view().prefill_tokens_per_s == pytest.approx(50_000)  # its own claim first
    finally:
        await pool.close()
