"""A finished request is reported (metrics, its log line, the tenant's usage) after its answer is
on its way and before anything read after it: the callback runs at the loop's next turn, not in
the request's own path (``gateway.core.accounting``)."""

from __future__ import annotations

import asyncio

import structlog

from prefixgate.gateway.nodeclient.fake import FakeNodeClient, Tokens, fake_status
from tests.unit.seam_support import Harness, harness


def _counted(h: Harness) -> float:
    requests = h.pipeline.executor.metrics.requests
    return float(sum(s.value for m in requests.collect() for s in m.samples if s.name.endswith("_total")))


async def test_a_request_is_reported_at_the_next_turn_of_the_loop_not_in_its_own_path() -> None:
    node = FakeNodeClient(
        "d1", status=fake_status("d1", "decode"), generate=lambda p: Tokens(texts=("a", "b"))
    )
    async with harness(("decode", node)) as h:
        with structlog.testing.capture_logs() as logs:
            ex = await h.pipeline.execute(h.prep())
            assert "".join([d.text async for d in ex.stream()]) == "ab"  # closed: the answer is whole
            assert _counted(h) == 0 and not [e for e in logs if e["event"] == "request"]
            await asyncio.sleep(0)  # the loop turns: whatever is read next sees it counted
            assert _counted(h) == 1
            (line,) = [e for e in logs if e["event"] == "request"]
            assert line["outcome"] == "ok" and line["completion_tokens"] == 2


async def test_the_embedded_index_holds_a_requests_blocks_once_its_first_token_is_out() -> None:
    """No batching interval for the embedded index: at the loop's next turn after the first
    token, a request right behind this one (the next turn of a conversation) is routed by its
    blocks. A shared index is a round trip away and keeps its batching writer."""
    node = FakeNodeClient(
        "d1", status=fake_status("d1", "decode"), generate=lambda p: Tokens(texts=("a", "b"))
    )
    async with harness(("decode", node)) as h:
        prep = h.prep()
        ex = await h.pipeline.execute(prep)  # the first token is in
        assert await h.pipeline.index.lookup(prep.hashes, ["d1"]) == {"d1": 0}  # not in its own path
        await asyncio.sleep(0)  # the loop's next turn
        held = await h.pipeline.index.lookup(prep.hashes, ["d1"])
        assert held == {"d1": len(prep.hashes)} and len(prep.hashes) > 0
        assert h.pipeline.accounting.writer.pending == 0  # not queued as well
        _ = [d async for d in ex.stream()]
