"""A node declared gone (its breaker opened) ends the attempts still waiting on it for a first
token at once, retried elsewhere, at the default 60 s first-token timeout; a node no longer needed
is let be."""

from __future__ import annotations

import asyncio

import pytest

from prefixgate.gateway.cluster.nodes import Departure, Node, went_down
from prefixgate.gateway.core.execute import Target, abandoned
from prefixgate.gateway.nodeclient.fake import Fail, FakeNodeClient, Tokens, fake_status
from prefixgate.gateway.routing import Decision
from prefixgate.gateway.vocab import FailureKind, Mode, Stage
from tests.unit.seam_support import Harness, harness

pytestmark = pytest.mark.timeout(10)

TIMEOUT = Fail(FailureKind.TIMEOUT)


def test_only_the_end_of_an_up_spell_declares_a_node_gone_and_each_spell_has_its_own_watchers() -> None:
    assert went_down(True, False) and not went_down(False, False) and not went_down(False, True)
    d = Departure()
    spell = d.spell
    calls: list[str] = []
    spell.watch(lambda: calls.append("first"))
    unwatch = spell.watch(lambda: calls.append("unwatched"))
    unwatch()
    assert not d.observe(True) and not spell.ended and calls == []
    assert d.observe(False) and spell.ended and calls == ["first"]
    spell.watch(lambda: calls.append("late"))  # an ended spell calls back at once
    assert calls == ["first", "late"]
    after = d.spell
    after.watch(lambda: calls.append("after"))
    assert after is not spell and not after.ended
    assert not d.observe(False) and not after.ended  # still down: no second departure
    assert calls == ["first", "late"]
    assert not d.observe(True) and d.observe(False) and after.ended and calls[-1] == "after"


def _node(address: str, role: str) -> Node:
    return Node(role, address, FakeNodeClient(address))


def test_an_attempt_is_abandoned_only_for_a_node_it_still_needs() -> None:
    p, d, other = _node("p1", "prefill"), _node("d1", "decode"), _node("p2", "prefill")
    split = Target(p, d, Decision("p1", ""), Mode.DISAGGREGATED, "")
    f = abandoned(split, {p}, prefill_reported=False)
    assert f is not None and (f.node_id, f.stage, f.kind) == ("p1", Stage.PREFILL, FailureKind.GONE)
    assert abandoned(split, {p}, prefill_reported=True) is None  # its part is done
    f = abandoned(split, {d}, prefill_reported=True)
    assert f is not None and (f.node_id, f.stage) == ("d1", Stage.DECODE)
    assert abandoned(split, {other}, prefill_reported=False) is None
    whole = Target(None, d, Decision("d1", ""), Mode.MONOLITHIC, "")
    f = abandoned(whole, {d}, prefill_reported=False)
    assert f is not None and f.stage == Stage.GENERATE


async def _probe_out(h: Harness, node: Node) -> None:
    """The node's probes fail until its breaker opens."""
    assert isinstance(node.client, FakeNodeClient)
    node.client.status_script = TIMEOUT
    while node.breaker.state != "open":
        await h.pool.refresh(node)


async def test_a_hung_prefill_is_retried_once_its_node_is_probed_out_not_after_the_first_token_limit() -> (
    None
):
    p1 = FakeNodeClient("p1", prefill=Tokens(delay_s=30.0))
    p2 = FakeNodeClient("p2", status=fake_status("p2", "prefill", queued=2))  # p1 first
    async with harness(("prefill", p1), ("prefill", p2), ("decode", FakeNodeClient("d1"))) as h:
        assert h.pipeline.settings.first_token_timeout_s == 60  # the default
        task = asyncio.create_task(h.pipeline.execute(h.prep()))
        while "prefill" not in p1.calls:
            await asyncio.sleep(0.01)
        await _probe_out(h, h.node("p1"))
        async with asyncio.timeout(5):
            ex = await task
        assert ex.route == Mode.DISAGGREGATED and ex.prefill_node is h.node("p2") and ex.attempts == 2
        assert ex.notes["retries_node_gone"] == 1
        metrics = h.pipeline.executor.metrics.registry
        labels = {"stage": "prefill", "reason": "node_gone"}
        assert metrics.get_sample_value("prefixgate_retries_total", labels) == 1
        p1_node, d1 = h.node("p1"), h.node("d1")
        assert p1_node.local_requests == 0 and p1_node.breaker.failures == 0  # the probes' verdict only
        assert d1.breaker.state == "closed" and d1.breaker.failures == 0
        await ex.close()


async def test_a_prefill_node_gone_after_its_part_leaves_the_attempt_to_its_decode_node() -> None:
    p1 = FakeNodeClient("p1")
    d1 = FakeNodeClient("d1", decode=Tokens(delay_s=0.3))
    async with harness(("prefill", p1), ("decode", d1)) as h:
        task = asyncio.create_task(h.pipeline.execute(h.prep()))
        while "decode" not in d1.calls:
            await asyncio.sleep(0.01)
        await _probe_out(h, h.node("p1"))
        async with asyncio.timeout(5):
            ex = await task
        assert ex.attempts == 1 and ex.prefill_node is h.node("p1") and ex.notes["retries_node_gone"] == 0
        await ex.close()


async def test_a_decode_node_whose_requests_open_its_breaker_releases_the_attempts_waiting_on_it() -> None:
    d1 = FakeNodeClient("d1", generate=Tokens(delay_s=30.0))
    d2 = FakeNodeClient("d2", status=fake_status("d2", "decode", queued=2))  # d1 first
    async with harness(("decode", d1), ("decode", d2)) as h:
        task = asyncio.create_task(h.pipeline.execute(h.prep()))
        while "generate" not in d1.calls:
            await asyncio.sleep(0.01)
        node = h.node("d1")
        for _ in range(node.breaker.threshold):  # failed requests elsewhere open its breaker
            node.breaker.on_failure(asyncio.get_running_loop().time())
        node.settle()
        async with asyncio.timeout(5):
            ex = await task
        assert ex.decode_node is h.node("d2") and ex.attempts == 2
        assert d1.streams[0].cancelled  # its work on the gone node is cancelled
        await ex.close()
