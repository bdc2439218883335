"""What every handoff's token stream shares: the decode leg's deltas once ``_begin`` has the
legs going, ``cached_tokens`` from the prefill leg's answer (else the decode leg's), and a close
that ends the prefill leg at once and the decode leg by the abort rule (``legs.close_decode``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from prefixgate.gateway.nodeclient.base import (
    FailedStream,
    NodeClient,
    NodeFailure,
    PrefillReport,
    Prompt,
    StageTimings,
    TokenDelta,
    TokenStream,
)
from prefixgate.gateway.nodeclient.handoff.legs import (
    DecodeLeg,
    PrefillAnswer,
    PrefillLeg,
    close_decode,
    retrieved,
)

P_co = TypeVar("P_co", covariant=True)


class PairFactory(Protocol[P_co]):
    """A transport's side of a handoff: the legs' maker for this (prefill, decode) pair, or why
    the pair cannot serve (a node of another protocol or engine family)."""

    def __call__(
        self, prompt: Prompt, prefill: NodeClient, decode: NodeClient, timeout: float
    ) -> P_co | NodeFailure: ...


class SplitStream:
    """One split request as a TokenStream (``aclose`` is idempotent). ``whole_answer``: the
    decode leg answers in one message (``base.TokenStream``)."""

    def __init__(self, *, whole_answer: bool = False) -> None:
        self.whole_answer = whole_answer
        self.cached_tokens = 0
        self.timings = StageTimings()
        self.prefill: PrefillReport | None = None
        self.on_prefill: Callable[[], None] | None = None  # ``base.PrefillWatched``
        self._prefill_leg: PrefillLeg | None = None
        self._decode: DecodeLeg | None = None
        self._first: asyncio.Future[None] | None = None
        self._in_flight = True  # a KV transfer to the decode leg may be under way
        self._answer_cached: int | None = None  # what the prefill leg reported
        self._started = False
        self._closed = False
        self._ended = False

    @property
    def rid(self) -> str:
        """The engine's request id of both legs ("" before they are built)."""
        return self._decode.rid if self._decode is not None else ""

    def __aiter__(self) -> SplitStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._closed:
            raise StopAsyncIteration
        try:
            if not self._started:
                self._started = True
                return await self._begin()
            assert self._decode is not None
            d = await anext(self._decode)
            self._take_cached()
            return d
        except BaseException:
            await self.aclose()
            raise

    async def _begin(self) -> TokenDelta:
        raise NotImplementedError

    def _start_prefill(self, leg: PrefillLeg) -> asyncio.Future[PrefillAnswer]:
        self._prefill_leg = leg
        run = leg.start()
        run.add_done_callback(retrieved)
        return run

    def _start_decode(self, leg: DecodeLeg) -> asyncio.Future[None]:
        self._decode = leg
        self._first = leg.start()
        self._first.add_done_callback(retrieved)
        return self._first

    def _report(self, answer: PrefillAnswer, prefill_s: float = 0.0) -> None:
        self._answer_cached = answer.cached_tokens
        cached = answer.cached_tokens or 0
        self.prefill = PrefillReport(cached, 0.0, prefill_s, 0.0, 0)
        self.cached_tokens = cached
        if self.on_prefill is not None:
            self.on_prefill()

    def _take_cached(self) -> None:
        if self._answer_cached is None and self._decode is not None:
            self.cached_tokens = self._decode.cached_tokens

    async def aclose(self) -> None:
        self._closed = True
        if self._ended:
            return
        self._ended = True
        if self._prefill_leg is not None:
            await self._prefill_leg.abort()
        if self._decode is not None:
            await close_decode(self._decode, self._first, in_flight=self._in_flight)


S = TypeVar("S")


class PairedHandoff(Generic[S]):
    """A handoff over whichever transport ``pair`` speaks (``base.Handoff``): the pair's
    refusal as a failed stream, else the handoff's own stream over the pair's legs."""

    def __init__(self, pair: PairFactory[S]) -> None:
        self._pair = pair

    def start(
        self, prompt: Prompt, prefill: NodeClient, decode: NodeClient, *, timeout: float
    ) -> TokenStream:
        made = self._pair(prompt, prefill, decode, timeout)
        if isinstance(made, NodeFailure):
            return FailedStream(made)
        return self.stream(made)

    def stream(self, pair: S) -> SplitStream:
        raise NotImplementedError
