"""The gateway routes a request behind one still computing its prefix (in-flight prefixes)."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefixgate.gateway.nodeclient.fake import Fail, FakeNodeClient, Tokens
from prefixgate.gateway.vocab import FailureKind
from tests.unit.seam_support import harness

pytestmark = pytest.mark.timeout(10)

SLOW = Tokens(("a", "b"), delay_s=0.3)  # the first token (end of prefill) comes after 0.3 s


@pytest.mark.parametrize("inflight", [True, False])
async def test_a_request_follows_its_prefix_while_it_is_computing(inflight: bool) -> None:
    m1, m2 = FakeNodeClient("m1", generate=SLOW), FakeNodeClient("m2", generate=SLOW)
    async with harness(("monolithic", m1), ("monolithic", m2), inflight_prefixes=inflight) as h:
        first = asyncio.create_task(h.pipeline.execute(h.prep(400)))
        await asyncio.sleep(0.05)  # routed, prefill still running: the index knows nothing yet
        assert await h.pipeline.index.lookup(h.prep(400).hashes) == {}
        second = await h.pipeline.execute(h.prep(400))
        a = await first
        if inflight:
            assert second.decode_node is a.decode_node  # queued behind its prefix
            assert second.predicted_tokens == 6 * 64  # the 6 full blocks being computed there
        else:
            assert second.decode_node is not a.decode_node  # the index alone: the idle node
            assert second.predicted_tokens == 0
        assert second.notes["inflight_gain_tokens"] == 6 * 64  # noted either way
        await a.close()
        await second.close()
        assert len(h.pipeline.inflight_prefixes) == 2  # both served: kept for the grace only


async def test_a_failed_attempt_releases_its_prefix_at_once() -> None:
    bad = Fail(FailureKind.UNAVAILABLE, delay_s=0.1)
    m1, m2 = FakeNodeClient("m1", generate=bad), FakeNodeClient("m2", generate=SLOW)
    async with harness(("monolithic", m1), ("monolithic", m2)) as h:
        for _ in range(2):  # whichever node the turn tries first
            prep = h.prep(400)
            ex = await h.pipeline.execute(prep)
            assert ex.decode_node.id == "m2"
            await ex.close()
        # m1's failed attempt held nothing after it failed; m2's chain stays for the grace only.
        assert h.pipeline.inflight_prefixes.hits(prep.hashes, time.monotonic()) == {"m2": 6}
        assert len(h.pipeline.inflight_prefixes) == 2
