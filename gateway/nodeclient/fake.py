"""A scripted node client, like httpx's MockTransport: every call consults a script.

A reply is ``Tokens`` (stream these texts, optionally breaking after a few, after a delay) or
``Fail`` (a NodeFailure of this kind, optionally at another stage). A script entry is a reply, a
list of replies (one a call, the last one repeating) or a function of the prompt. The clients
record what was asked of them, so tests assert on behaviour, not on internals.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from prefixgate.gateway.nodeclient.base import (
    Capabilities,
    FailedStream,
    KVEvent,
    KVFormat,
    NodeClient,
    NodeFailure,
    NodeStatus,
    PrefillReport,
    Prompt,
    StageTimings,
    TokenDelta,
)
from prefixgate.gateway.vocab import FailureKind, Stage

FAKE_FORMAT = KVFormat("fake-model", 16, "f32", "token", 64)


@dataclass(frozen=True, slots=True)
class Tokens:
    """Succeed: stream ``texts`` (the last one finishing), after ``delay_s``; with ``break_after``,
    fail mid-stream once that many deltas are out; ``stall_s`` waits before every later delta."""

    texts: Sequence[str] = ("Hello", " world")
    finish_reason: str = "stop"
    cached_tokens: int = 0
    delay_s: float = 0.0
    stall_s: float = 0.0
    break_after: int | None = None


@dataclass(frozen=True, slots=True)
class Fail:
    """Fail with ``kind``; ``stage`` overrides where (TRANSFER on a prefill blames the decode node)."""

    kind: FailureKind = FailureKind.UNAVAILABLE
    stage: Stage | None = None
    detail: str = "scripted failure"
    delay_s: float = 0.0


Reply: TypeAlias = Tokens | Fail
Script: TypeAlias = Reply | list[Reply] | Callable[[Prompt], Reply]
StatusScript: TypeAlias = NodeStatus | Fail | list[NodeStatus | Fail]
ALL_CAPABILITIES = Capabilities(split=True, kv_events=True, pin=True, evict=True, warm=True, tenant_salt=True)


def fake_status(node_id: str, role: str, *, kv_format: KVFormat = FAKE_FORMAT, queued: int = 0) -> NodeStatus:
    return NodeStatus(
        node_id=node_id,
        role=role,
        engine="fake",
        kv_format=kv_format,
        capacity_blocks=1000,
        queued_requests=queued,
        instance_id=f"{node_id}-1",
    )


def _pick(script: Script, prompt: Prompt, n: int) -> Reply:
    if isinstance(script, list):
        return script[min(n, len(script) - 1)]
    if callable(script):
        return script(prompt)
    return script


class FakeTokenStream:
    """The reply's texts, delta ``i`` with token id ``resumed + i`` (its position in the output:
    a continuation, ``Prompt.resumed``, counts on from the tokens it continues)."""

    def __init__(self, node_id: str, stage: Stage, reply: Tokens, resumed: int = 0) -> None:
        self.node_id, self.stage, self.reply = node_id, stage, reply
        self.resumed = resumed
        self.cached_tokens = reply.cached_tokens
        self.timings = StageTimings()
        self.prefill: PrefillReport | None = None
        self.sent = 0
        self.closed = False
        self.cancelled = False

    def __aiter__(self) -> FakeTokenStream:
        return self

    async def __anext__(self) -> TokenDelta:
        r = self.reply
        if self.closed or self.sent >= len(r.texts):
            raise StopAsyncIteration
        if self.sent == 0 and r.delay_s:
            await asyncio.sleep(r.delay_s)
        elif self.sent and r.stall_s:
            await asyncio.sleep(r.stall_s)
        if r.break_after is not None and self.sent >= r.break_after:
            self.closed = True
            raise NodeFailure(self.node_id, self.stage, FailureKind.INTERNAL, "scripted break")
        self.sent += 1
        last = self.sent == len(r.texts)
        if last:
            self.closed = True
        at = self.resumed + self.sent
        return TokenDelta(r.texts[self.sent - 1], r.finish_reason if last else "", at, token_ids=(at,))

    async def aclose(self) -> None:
        if not self.closed:
            self.cancelled = True
        self.closed = True


class FakeNodeClient:
    """A node whose every answer comes from its script."""

    def __init__(
        self,
        address: str,
        *,
        status: StatusScript | None = None,
        generate: Script = Tokens(),
        prefill: Script = Tokens(),
        decode: Script = Tokens(),
        events: Sequence[KVEvent] = (),
        capabilities: Capabilities = ALL_CAPABILITIES,
    ) -> None:
        self._address = address
        self.status_script: StatusScript = status if status is not None else fake_status(address, "decode")
        self.scripts: dict[str, Script] = {"generate": generate, "prefill": prefill, "decode": decode}
        self.events = list(events)
        self._capabilities = capabilities
        self.calls: list[str] = []
        self.streams: list[FakeTokenStream] = []
        self.closed = False

    @property
    def address(self) -> str:
        return self._address

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def handoff(self) -> FakeHandoff:
        return FAKE_HANDOFF

    def reply(self, op: str, prompt: Prompt) -> Reply:
        n = self.calls.count(op)
        self.calls.append(op)
        return _pick(self.scripts[op], prompt, n)

    async def status(self, timeout: float) -> NodeStatus:
        n = self.calls.count("status")
        self.calls.append("status")
        script = self.status_script
        answer = script[min(n, len(script) - 1)] if isinstance(script, list) else script
        if isinstance(answer, Fail):
            if answer.delay_s:
                await asyncio.sleep(min(answer.delay_s, timeout))
            raise NodeFailure(self._address, answer.stage or Stage.PROBE, answer.kind, answer.detail)
        return answer

    def stream(self, stage: Stage, reply: Tokens, resumed: int = 0) -> FakeTokenStream:
        s = FakeTokenStream(self._address, stage, reply, resumed)
        self.streams.append(s)
        return s

    def generate(self, prompt: Prompt, *, timeout: float) -> FakeTokenStream | _FailingStream:
        reply = self.reply("generate", prompt)
        if isinstance(reply, Fail):
            return _FailingStream(
                NodeFailure(self._address, reply.stage or Stage.GENERATE, reply.kind, reply.detail),
                reply.delay_s,
            )
        return self.stream(Stage.GENERATE, reply, prompt.resumed)

    async def kv_events(self, since_seq: int) -> AsyncGenerator[KVEvent, None]:
        self.calls.append("kv_events")
        for ev in self.events:
            if ev.seq > since_seq or since_seq == 0:
                yield ev

    async def warm(self, prompt: Prompt, *, pin_seconds: float, timeout: float) -> PrefillReport:
        reply = self.reply("prefill", prompt)
        if isinstance(reply, Fail):
            raise NodeFailure(self._address, reply.stage or Stage.PREFILL, reply.kind, reply.detail)
        return PrefillReport(reply.cached_tokens, 0.0, 0.0, 0.0, 0)

    async def evict(self, hashes: Sequence[int], *, everything: bool, timeout: float) -> list[int]:
        self.calls.append("evict")
        return list(hashes)

    async def pin(self, hashes: Sequence[int], *, seconds: float, timeout: float) -> tuple[int, int]:
        self.calls.append("pin")
        return len(hashes), 0

    async def close(self) -> None:
        self.closed = True


class _FailingStream:
    """A stream whose first read fails (after an optional delay)."""

    def __init__(self, failure: NodeFailure, delay_s: float = 0.0) -> None:
        self.failure, self.delay_s = failure, delay_s
        self.cached_tokens = 0
        self.timings = StageTimings()
        self.prefill: PrefillReport | None = None
        self.done = False

    def __aiter__(self) -> _FailingStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self.done:
            raise StopAsyncIteration
        self.done = True
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        raise self.failure

    async def aclose(self) -> None:
        self.done = True


@dataclass
class _FakeSplit:
    """Prefill leg on the prefill fake, then the decode fake's stream."""

    prompt: Prompt
    prefill_node: FakeNodeClient
    decode_node: FakeNodeClient
    cached_tokens: int = 0
    timings: StageTimings = field(default_factory=StageTimings)
    prefill: PrefillReport | None = None
    inner: FakeTokenStream | None = None
    closed: bool = False

    def __aiter__(self) -> _FakeSplit:
        return self

    async def __anext__(self) -> TokenDelta:
        if self.closed:
            raise StopAsyncIteration
        if self.inner is None:
            await self._prefill()
        assert self.inner is not None
        try:
            d = await self.inner.__anext__()
        except NodeFailure:
            self.closed = True
            raise
        self.cached_tokens = self.inner.cached_tokens or self.cached_tokens
        return d

    async def _prefill(self) -> None:
        p, d = self.prefill_node, self.decode_node
        reply = p.reply("prefill", self.prompt)
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if isinstance(reply, Fail):
            self.closed = True
            stage = reply.stage or Stage.PREFILL
            blamed = d.address if stage in (Stage.TRANSFER, Stage.DECODE) else p.address
            raise NodeFailure(blamed, stage, reply.kind, reply.detail)
        self.prefill = PrefillReport(reply.cached_tokens, 0.0, 0.001, 0.0, 0)
        self.cached_tokens = reply.cached_tokens
        dreply = d.reply("decode", self.prompt)
        if isinstance(dreply, Fail):
            self.closed = True
            raise NodeFailure(d.address, dreply.stage or Stage.DECODE, dreply.kind, dreply.detail)
        self.inner = d.stream(Stage.DECODE, dreply, self.prompt.resumed)

    async def aclose(self) -> None:
        self.closed = True
        if self.inner is not None:
            await self.inner.aclose()


class FakeHandoff:
    """Split serving between two fakes: the prefill fake's ``prefill`` script, then the decode
    fake's ``decode`` script."""

    def start(
        self, prompt: Prompt, prefill: NodeClient, decode: NodeClient, *, timeout: float
    ) -> _FakeSplit | FailedStream:
        if not isinstance(prefill, FakeNodeClient) or not isinstance(decode, FakeNodeClient):
            refused = "fakes pair with fakes only"
            return FailedStream(
                NodeFailure(decode.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED, refused)
            )
        return _FakeSplit(prompt, prefill, decode)


FAKE_HANDOFF = FakeHandoff()
