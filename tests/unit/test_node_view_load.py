"""A node's load as the policy sees it: our own work counted locally, the status adding only others'."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixgate.gateway.cluster.nodes import NodePool
from prefixgate.gateway.nodeclient.fake import FakeNodeClient, fake_status

pytestmark = pytest.mark.timeout(10)


async def test_our_requests_done_since_the_poll_are_not_load_and_others_work_is() -> None:
    busy = replace(fake_status("m1", "monolithic"), running_requests=3, queued_tokens=5000)
    more = replace(busy, running_requests=5, queued_tokens=9000)
    client = FakeNodeClient("m1", status=[busy, more])
    pool = NodePool(connect={"m1": client}.__getitem__, probe_timeout_s=0.2, poll=False)
    try:
        node = pool.add("monolithic", "m1")
        # At the poll: one request of ours in prefill (5,000 tokens), two decoding.
        node.local_requests, node.local_tokens, node.active_streams = 1, 5000, 2
        assert await pool.refresh(node)
        v = node.view()
        assert (v.outstanding_requests, v.outstanding_tokens) == (1, 5000)  # ours, counted once
        # All three finished after the poll: the node is idle, not 3 requests / 5,000 tokens busy.
        node.local_requests, node.local_tokens, node.active_streams = 0, 0, 0
        v = node.view()
        assert (v.outstanding_requests, v.outstanding_tokens) == (0, 0)
        # Next poll: 2 more requests and 4,000 more tokens than ours (none now) came from elsewhere.
        node.local_requests, node.local_tokens = 0, 0
        node.active_streams = 3
        assert await pool.refresh(node)
        v = node.view()
        assert (v.outstanding_requests, v.outstanding_tokens) == (2, 9000)
        node.local_requests, node.local_tokens = 1, 700  # one of ours sent since: counted locally
        v = node.view()
        assert (v.outstanding_requests, v.outstanding_tokens) == (3, 9700)
    finally:
        await pool.close()


async def test_a_request_load_is_counted_while_it_runs_and_released_however_it_ends() -> None:
    client = FakeNodeClient("m1", status=[fake_status("m1", "monolithic")])
    pool = NodePool(connect={"m1": client}.__getitem__, probe_timeout_s=0.2, poll=False)
    try:
        node = pool.add("monolithic", "m1")
        assert await pool.refresh(node)
        with node.load(700), node.load(300):
            v = node.view()
            assert (v.outstanding_requests, v.outstanding_tokens) == (2, 1000)
        with pytest.raises(RuntimeError), node.load(500):
            raise RuntimeError("the attempt failed")
        v = node.view()
        assert (v.outstanding_requests, v.outstanding_tokens) == (0, 0)
    finally:
        await pool.close()
