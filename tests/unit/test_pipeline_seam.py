"""The execution path against scripted fake nodes: retries, fallback, overload, broken streams,
KV-format pairing, cancellation. Each runs in milliseconds."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest

from prefixgate.gateway.core.errors import Overloaded, StreamBroken, Unavailable
from prefixgate.gateway.core.pipeline import Execution
from prefixgate.gateway.nodeclient import Prompt
from prefixgate.gateway.nodeclient.fake import FAKE_FORMAT, Fail, FakeNodeClient, Reply, Tokens, fake_status
from prefixgate.gateway.nodeclient.prefixgate_grpc import PUSH_HANDOFF, PushHandoff
from prefixgate.gateway.vocab import FailureKind, Mode, Stage
from tests.unit.seam_support import harness

pytestmark = pytest.mark.timeout(10)


def first_call_fails(kind: FailureKind, stage: Stage | None = None) -> Callable[[Prompt], Reply]:
    """A script shared by several fakes: the first call anywhere fails, later ones succeed."""
    calls = {"n": 0}

    def script(prompt: Prompt) -> Reply:
        calls["n"] += 1
        return Fail(kind, stage) if calls["n"] == 1 else Tokens(cached_tokens=64)

    return script


async def drain(ex: Execution) -> list[str]:
    return [d.text async for d in ex.stream()]


async def test_a_failed_prefill_is_retried_on_the_other_prefill_node_before_the_first_token() -> None:
    script = first_call_fails(FailureKind.UNAVAILABLE)
    p1 = FakeNodeClient("p1", prefill=script)
    p2 = FakeNodeClient("p2", prefill=script)
    d1 = FakeNodeClient("d1")
    async with harness(("prefill", p1), ("prefill", p2), ("decode", d1)) as h:
        ex = await h.pipeline.execute(h.prep())
        assert ex.route == Mode.DISAGGREGATED and ex.attempts == 2
        (failed,) = [n for n in (h.node("p1"), h.node("p2")) if n.breaker.failures]
        assert ex.prefill_node is not None and ex.prefill_node is not failed
        assert failed.breaker.failures == 1 and "prefill on" in failed.last_error
        assert p1.calls.count("prefill") == p2.calls.count("prefill") == 1
        assert await drain(ex) == ["Hello", " world"] and ex.finish_reason == "stop"
        assert ex.cached_tokens == 64 and ex.completion_tokens == 2
        assert h.node("d1").active_streams == 0 and h.node("d1").breaker.failures == 0


async def test_a_decode_node_that_lost_the_pages_is_retried_on_another_decode_node() -> None:
    script = first_call_fails(FailureKind.HANDLE_GONE)
    d1 = FakeNodeClient("d1", decode=script)
    d2 = FakeNodeClient("d2", decode=script)
    async with harness(("prefill", FakeNodeClient("p1")), ("decode", d1), ("decode", d2)) as h:
        ex = await h.pipeline.execute(h.prep())
        assert ex.route == Mode.DISAGGREGATED and ex.attempts == 2
        assert {h.node("d1").breaker.failures, h.node("d2").breaker.failures} == {0, 1}
        assert ex.decode_node.breaker.failures == 0  # served by the one that did not fail
        assert h.node("p1").breaker.failures == 0  # the prefill node did its part both times
        await ex.close()


async def test_a_refused_transfer_is_blamed_on_the_decode_node_not_the_prefill_node() -> None:
    p1 = FakeNodeClient("p1", prefill=Fail(FailureKind.FORMAT_REFUSED, Stage.TRANSFER))
    d1, d2, m1 = FakeNodeClient("d1"), FakeNodeClient("d2"), FakeNodeClient("m1")
    async with harness(("prefill", p1), ("decode", d1), ("decode", d2), ("monolithic", m1)) as h:
        ex = await h.pipeline.execute(h.prep())
        # Both decode nodes refused the pages: the split failed, and not through the prefill node.
        assert h.node("p1").breaker.failures == 0
        assert h.node("d1").breaker.failures == 1 and h.node("d2").breaker.failures == 1
        assert ex.route == Mode.FALLBACK and ex.decode_node is h.node("m1")
        assert "transfer on d1: format_refused" in ex.reason
        await ex.close()


async def test_the_split_failing_everywhere_falls_back_to_monolithic_serving() -> None:
    p1 = FakeNodeClient("p1", prefill=Fail(FailureKind.UNAVAILABLE))
    d1 = FakeNodeClient("d1", generate=Tokens(texts=("whole",), cached_tokens=0))
    async with harness(("prefill", p1), ("decode", d1)) as h:
        ex = await h.pipeline.execute(h.prep())
        assert ex.route == Mode.FALLBACK and ex.prefill_node is None and ex.decode_node is h.node("d1")
        assert ex.reason.startswith("split pipeline failed: prefill on p1: unavailable")
        assert await drain(ex) == ["whole"]
        assert d1.calls.count("generate") == 1 and "decode" not in d1.calls


async def test_every_node_overloaded_is_overloaded_and_opens_no_breaker() -> None:
    full = Fail(FailureKind.OVERLOADED)
    nodes = [
        ("prefill", FakeNodeClient("p1", prefill=full)),
        ("decode", FakeNodeClient("d1", generate=full)),
        ("decode", FakeNodeClient("d2", generate=full)),
    ]
    async with harness(*nodes) as h:
        with pytest.raises(Overloaded) as info:
            await h.pipeline.execute(h.prep())
        assert info.value.retry_after == 1 and info.value.code == "overloaded"
        assert all(n.breaker.state == "closed" and n.breaker.failures == 0 for n in h.pool.nodes.values())
        assert all(n.local_requests == 0 and n.local_tokens == 0 for n in h.pool.nodes.values())


async def test_nodes_down_everywhere_is_unavailable_within_bounded_attempts() -> None:
    down = Fail(FailureKind.UNAVAILABLE)
    p1 = FakeNodeClient("p1", prefill=down)
    d = [FakeNodeClient(f"d{i}", generate=down) for i in range(1, 5)]
    async with harness(("prefill", p1), *(("decode", c) for c in d)) as h:
        with pytest.raises(Unavailable) as info:
            await h.pipeline.execute(h.prep())
        assert "no node could serve the request" in info.value.message
        # At most MAX_ATTEMPTS whole-request attempts after the split failed.
        assert sum(c.calls.count("generate") for c in d) == 3


async def test_a_break_after_the_first_token_ends_the_stream_with_an_error_and_no_retry() -> None:
    d1 = FakeNodeClient("d1", decode=Tokens(texts=("a", "b", "c", "d"), break_after=2))
    d2 = FakeNodeClient("d2")
    async with harness(("prefill", FakeNodeClient("p1")), ("decode", d1), ("decode", d2)) as h:
        h.node("d2").draining = True  # the request goes to d1
        ex = await h.pipeline.execute(h.prep())
        got: list[str] = []
        with pytest.raises(StreamBroken, match="failed mid-stream"):
            async for d in ex.stream():
                got.append(d.text)
        assert got == ["a", "b"] and ex.outcome == "broken"
        assert "decode" not in d2.calls and "generate" not in d2.calls  # nothing retried
        node = h.node("d1")
        assert node.active_streams == 0 and node.breaker.failures == 1 and "scripted break" in node.last_error


async def test_a_decode_node_with_another_kv_format_is_never_paired() -> None:
    other = dataclasses.replace(FAKE_FORMAT, dtype="bf16")
    d_other = FakeNodeClient("d-other", status=fake_status("d-other", "decode", kv_format=other))
    d_same = FakeNodeClient("d-same")
    async with harness(("prefill", FakeNodeClient("p1")), ("decode", d_other), ("decode", d_same)) as h:
        for _ in range(6):
            ex = await h.pipeline.execute(h.prep())
            assert ex.route == Mode.DISAGGREGATED and ex.decode_node is h.node("d-same")
            await drain(ex)
        assert "decode" not in d_other.calls
        h.node("d-same").draining = True
        plan = h.pipeline.decide(h.prep(), {})
        assert plan.mode.mode == Mode.FALLBACK and "dtype 'f32' != 'bf16'" in plan.mode.reason
        ex = await h.pipeline.execute(h.prep())  # served whole instead, never split onto d-other
        assert ex.route == Mode.FALLBACK and "decode" not in d_other.calls
        await ex.close()


async def test_a_client_gone_during_prefill_cancels_the_node_work_and_releases_the_node() -> None:
    d1 = FakeNodeClient("d1", generate=Tokens(delay_s=5.0))
    async with harness(("decode", d1)) as h:
        task = asyncio.create_task(h.pipeline.execute(h.prep()))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        node = h.node("d1")
        assert d1.streams[0].cancelled
        assert node.local_requests == 0 and node.local_tokens == 0 and not node.breaker.trial_in_flight


async def test_a_client_gone_mid_stream_gives_the_decode_node_its_stream_back_once() -> None:
    d1 = FakeNodeClient("d1", generate=Tokens(texts=("a", "b"), stall_s=30.0))
    async with harness(("decode", d1)) as h:
        node = h.node("d1")
        ex = await h.pipeline.execute(h.prep())
        assert node.active_streams == 1  # counted from the first token on
        got_first = asyncio.Event()

        async def client() -> None:
            async for _ in ex.stream():
                got_first.set()

        task = asyncio.create_task(client())
        await got_first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert d1.streams[0].cancelled and ex.outcome == "incomplete"
        assert node.active_streams == 0
        await ex.close()  # closing again gives nothing back twice
        assert node.active_streams == 0


def first_call_hangs() -> Callable[[Prompt], Reply]:
    calls = {"n": 0}

    def script(prompt: Prompt) -> Reply:
        calls["n"] += 1
        return Tokens(delay_s=30.0) if calls["n"] == 1 else Tokens()

    return script


async def test_a_hung_prefill_fails_over_within_the_first_token_limit_and_spares_the_decode_node() -> None:
    script = first_call_hangs()
    p1 = FakeNodeClient("p1", prefill=script)
    p2 = FakeNodeClient("p2", prefill=script)
    async with harness(
        ("prefill", p1), ("prefill", p2), ("decode", FakeNodeClient("d1")), first_token_timeout_s=0.1
    ) as h:
        t0 = asyncio.get_running_loop().time()
        ex = await h.pipeline.execute(h.prep())
        assert asyncio.get_running_loop().time() - t0 < 1.0
        assert ex.route == Mode.DISAGGREGATED and ex.attempts == 2
        (hung,) = [n for n in (h.node("p1"), h.node("p2")) if n.breaker.failures]
        assert "prefill on" in hung.last_error and "timeout" in hung.last_error
        assert h.node("d1").breaker.failures == 0 and not h.node("d1").breaker.trial_in_flight
        await ex.close()


async def test_silent_whole_request_nodes_are_left_for_another_and_their_work_cancelled() -> None:
    calls = {"n": 0}

    def two_hang(prompt: Prompt) -> Reply:
        calls["n"] += 1
        return Tokens(delay_s=30.0) if calls["n"] <= 2 else Tokens()

    fakes = [FakeNodeClient(f"d{i}", generate=two_hang) for i in (1, 2, 3)]
    async with harness(*(("decode", f) for f in fakes), first_token_timeout_s=0.05) as h:
        ex = await h.pipeline.execute(h.prep())
        assert ex.attempts == 3 and ex.decode_node.breaker.failures == 0
        silent = [f for f in fakes if f.streams[0].reply.delay_s]
        assert len(silent) == 2 and all(f.streams[0].cancelled for f in silent)
        for f in silent:
            node = h.node(f.address)
            assert (
                node.local_requests == 0 and node.breaker.failures == 1 and "generate on" in node.last_error
            )
        await ex.close()


async def test_a_stream_that_stalls_after_the_first_token_ends_with_an_error_charged_to_the_decode_node() -> (
    None
):
    d1 = FakeNodeClient("d1", decode=Tokens(texts=("a", "b", "c"), stall_s=30.0))
    async with harness(("prefill", FakeNodeClient("p1")), ("decode", d1), stall_timeout_s=0.1) as h:
        ex = await h.pipeline.execute(h.prep())
        got: list[str] = []
        with pytest.raises(StreamBroken, match="timeout"):
            async for d in ex.stream():
                got.append(d.text)
        assert got == ["a"] and ex.outcome == "broken"
        assert d1.streams[0].cancelled  # the node stops generating for a client that got an error
        assert h.node("d1").breaker.failures == 1 and "no token for 0.1s" in h.node("d1").last_error
        assert h.node("p1").breaker.failures == 0 and h.node("d1").active_streams == 0


async def test_a_slow_stream_whose_every_token_comes_within_the_stall_timeout_is_not_cut() -> None:
    """The stall timeout bounds each wait for a token, not the stream: six tokens 0.06 s apart
    (0.3 s in all) under a 0.15 s stall timeout all arrive."""
    texts = ("a", "b", "c", "d", "e", "f")
    d1 = FakeNodeClient("d1", decode=Tokens(texts=texts, stall_s=0.06))
    async with harness(("prefill", FakeNodeClient("p1")), ("decode", d1), stall_timeout_s=0.15) as h:
        ex = await h.pipeline.execute(h.prep())
        got = [d.text async for d in ex.stream()]
        assert got == list(texts) and ex.outcome == "ok"
        assert h.node("d1").breaker.failures == 0


async def test_a_split_stuck_while_the_decode_node_fails_its_probes_is_charged_to_the_decode_node() -> None:
    p1 = FakeNodeClient("p1", prefill=first_call_hangs())
    d1, d2 = FakeNodeClient("d1"), FakeNodeClient("d2")
    async with harness(("prefill", p1), ("decode", d1), ("decode", d2), first_token_timeout_s=0.2) as h:
        task = asyncio.create_task(h.pipeline.execute(h.prep()))
        await asyncio.sleep(0.05)  # the prefill is stuck pushing pages; the probe finds its target gone
        target = h.node("d1")  # equal load: the decode nodes are taken in id order
        assert p1.calls.count("prefill") == 1 and target.breaker.state == "closed"
        target.reachable = False
        ex = await task
        assert ex.route == Mode.DISAGGREGATED and ex.attempts == 2 and ex.decode_node is not target
        assert target.breaker.failures == 1 and "transfer on" in target.last_error
        assert h.node("p1").breaker.failures == 0
        await ex.close()


class _PushingFake(FakeNodeClient):
    """A node of the push family (our gRPC nodes) facing a decode node of another family."""

    @property
    def handoff(self) -> PushHandoff:  # type: ignore[override]
        return PUSH_HANDOFF


async def test_a_pair_the_handoff_cannot_serve_is_refused_and_served_whole() -> None:
    d1 = FakeNodeClient("d1", generate=Tokens(texts=("whole",)))
    async with harness(("prefill", _PushingFake("p1")), ("decode", d1)) as h:
        ex = await h.pipeline.execute(h.prep())
        assert ex.route == Mode.FALLBACK and "transfer on d1: format_refused" in ex.reason
        assert await drain(ex) == ["whole"] and h.node("p1").breaker.failures == 0
