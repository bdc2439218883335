"""Migration over scripted nodes: a stream broken after its first token continues on another
node from the token ids already relayed, at most ``max_migrations`` times, at once when its node
is declared gone; nodes that cannot continue one keep the error (``gateway.core.migration``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import orjson
import pytest

from prefixgate.cachetier.tokenizer import unpack_ids
from prefixgate.gateway.core import choices
from prefixgate.gateway.core.errors import StreamBroken
from prefixgate.gateway.core.request import RequestContext
from prefixgate.gateway.httpfront import responses
from prefixgate.gateway.httpfront.headers import execution_headers
from prefixgate.gateway.nodeclient.base import Prompt
from prefixgate.gateway.nodeclient.fake import ALL_CAPABILITIES, FakeNodeClient, Tokens, fake_status
from tests.unit.seam_support import completion, harness

RESUMING = replace(ALL_CAPABILITIES, resume=True)
TEXTS = ("a", "b", "c", "d", "e", "f")


def _rest(break_after: int | None = None, stall_s: float = 0.0) -> Callable[[Prompt], Tokens]:
    """A node generating what is left of TEXTS after the tokens the prompt resumes."""

    def reply(p: Prompt) -> Tokens:
        return Tokens(texts=TEXTS[p.resumed :], break_after=break_after, stall_s=stall_s)

    return reply


def _node(address: str, queued: int = 0, **script: object) -> FakeNodeClient:
    return FakeNodeClient(
        address,
        status=fake_status(address, "decode", queued=queued),
        capabilities=RESUMING,
        **script,  # type: ignore[arg-type]
    )


async def test_a_stream_broken_mid_way_continues_on_another_node_from_the_ids_sent() -> None:
    d1 = _node("d1", generate=_rest(break_after=2))
    d2 = _node("d2", queued=5, generate=_rest())  # busier: the request starts on d1
    async with harness(("decode", d1), ("decode", d2)) as h:
        prep = h.prep()
        ex = await h.pipeline.execute(prep)
        got = [d.text async for d in ex.stream()]
        assert "".join(got) == "".join(TEXTS) and ex.finish_reason == "stop" and ex.outcome == "ok"
        assert (ex.migrations, ex.completion_tokens, ex.prompt_tokens) == (1, len(TEXTS), prep.prompt_tokens)
        assert ex.decode_node.id == "d2" and ex.failure is None
        resumed = [s for s in d2.streams if s.resumed]
        assert [s.resumed for s in resumed] == [2]  # continued after the two ids relayed
        assert h.node("d1").breaker.failures == 1 and h.node("d1").active_streams == 0
        assert h.node("d2").active_streams == 0
        assert h.pipeline.executor.metrics.migrations.labels("broken")._value.get() == 1


async def test_the_continuation_prompt_is_the_prompt_then_the_ids_sent() -> None:
    seen: list[Prompt] = []

    def d2_reply(p: Prompt) -> Tokens:
        seen.append(p)
        return Tokens(texts=TEXTS[p.resumed :])

    d1 = _node("d1", generate=_rest(break_after=3))
    d2 = _node("d2", queued=5, generate=d2_reply)
    async with harness(("decode", d1), ("decode", d2)) as h:
        prep = h.prep()
        ex = await h.pipeline.execute(prep)
        _ = [d async for d in ex.stream()]
        bs = h.pipeline.settings.block_size
    p = seen[-1]
    assert p.resumed == 3 and unpack_ids(p.tokens) == [*unpack_ids(prep.tokens), 1, 2, 3]
    # the prompt's blocks hash as they did (cache hits), the blocks after them on from the chain
    assert len(p.hashes) == p.token_count // bs and p.hashes[: len(prep.hashes)] == prep.hashes


async def test_past_max_migrations_the_stream_ends_with_the_error() -> None:
    d1 = _node("d1", generate=_rest(break_after=2))
    d2 = _node("d2", queued=5, generate=_rest(break_after=1))
    d3 = _node("d3", queued=9, generate=_rest())
    async with harness(("decode", d1), ("decode", d2), ("decode", d3), max_migrations=1) as h:
        ex = await h.pipeline.execute(h.prep())
        got: list[str] = []
        with pytest.raises(StreamBroken, match="failed mid-stream"):
            async for d in ex.stream():
                got.append(d.text)
        assert got == ["a", "b", "c"] and ex.migrations == 1 and ex.outcome == "broken"
        assert not d3.streams  # one migration allowed: d2's break is the end
        assert h.node("d2").breaker.failures == 1 and h.node("d2").active_streams == 0


async def test_a_node_that_cannot_continue_a_generation_keeps_the_error() -> None:
    d1 = FakeNodeClient("d1", generate=_rest(break_after=2))  # reports no resume
    d2 = _node("d2", queued=5, generate=_rest())
    async with harness(("decode", d1), ("decode", d2)) as h:
        ex = await h.pipeline.execute(h.prep())
        with pytest.raises(StreamBroken, match="failed mid-stream"):
            _ = [d async for d in ex.stream()]
        assert not d2.streams and ex.migrations == 0


async def test_a_continuation_no_node_can_start_counts_the_request_once() -> None:
    d1 = _node("d1", generate=_rest(break_after=2))
    d2 = FakeNodeClient("d2", status=fake_status("d2", "decode", queued=5))  # cannot continue one
    async with harness(("decode", d1), ("decode", d2)) as h:
        ex = await h.pipeline.execute(h.prep())
        with pytest.raises(StreamBroken, match="failed mid-stream"):
            _ = [d async for d in ex.stream()]
        await asyncio.sleep(0)  # reported once the answer is on its way (Accounting.report)
        requests = h.pipeline.executor.metrics.requests
        counted = {
            s.labels["outcome"]: s.value
            for m in requests.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }
    assert counted == {"broken": 1.0}, counted  # not also "failed" for the continuation


async def test_a_node_declared_gone_mid_stream_migrates_at_once() -> None:
    # The stall timeout at its 30 s default: only the node's departure ends the wait.
    d1 = _node("d1", generate=_rest(stall_s=30.0))
    d2 = _node("d2", queued=5, generate=_rest())
    async with harness(("decode", d1), ("decode", d2)) as h:
        ex = await h.pipeline.execute(h.prep())
        stream = ex.stream()
        assert (await anext(stream)).text == "a"
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        node = h.node("d1")
        for _ in range(node.breaker.threshold):
            node.breaker.on_failure(time.monotonic())
        node.settle()  # its breaker open: declared gone
        t0 = time.monotonic()
        rest = [(await waiting).text] + [d.text async for d in stream]
        assert time.monotonic() - t0 < 1.0
        assert "".join(["a", *rest]) == "".join(TEXTS) and ex.migrations == 1
        assert h.pipeline.executor.metrics.migrations.labels("gone")._value.get() == 1
        assert node.breaker.failures == node.breaker.threshold  # gone: not charged again


async def test_each_of_n_choices_migrates_on_its_own() -> None:
    d1 = _node("d1", generate=_rest(break_after=2))
    d2 = _node("d2", queued=5, generate=_rest())
    async with harness(("decode", d1), ("decode", d2)) as h:
        ch = await choices.start(h.pipeline, h.prep(), 2)
        texts = ["", ""]
        async for i, d in ch.stream():
            texts[i] += d.text
        assert texts == ["".join(TEXTS)] * 2
        on_d1 = [ex for ex in ch.executions if ex.attempts > 1]  # started on d1, went on on d2
        assert on_d1 and ch.migrations == len(on_d1) and ch.completion_tokens == 2 * len(TEXTS)


async def test_a_whole_answer_says_how_many_times_it_migrated() -> None:
    d1 = _node("d1", generate=_rest(break_after=2))
    d2 = _node("d2", queued=5, generate=_rest())
    async with harness(("decode", d1), ("decode", d2)) as h:
        parsed = completion(h.pipeline, "x" * 1600)
        ch = await choices.start(h.pipeline, h.pipeline.prepare(parsed, RequestContext("tenant")), 1)
        answer = await responses.complete(ch, parsed, "completion", execution_headers(ch.first))
    payload = orjson.loads(answer.body)
    assert payload["choices"][0]["text"] == "".join(TEXTS)
    assert payload["usage"]["completion_tokens"] == len(TEXTS) and payload["usage"]["prompt_tokens"] == 400
    assert answer.headers["x-prefixgate-migrations"] == "1"
