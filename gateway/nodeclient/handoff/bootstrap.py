"""SGLang's simultaneous bootstrap, for every transport (docs/engines.md, SGLang PD: bootstrap
host, port and room).

The same request (one request id; the prefill node's host, its bootstrap port and a fresh random
room) goes to both legs at once; they meet at the room, the prefill leg ends once the KV is
handed over, and the output is the decode leg's. The first delta goes out once the decode leg
produced its first item and the prefill leg is done (its report is set as soon as it is, so a
first token that never comes is the decode node's).

Blame: a prefill leg failing before the decode leg's first item fails the request as the
prefill node's (no hand-off happened: the decode leg is aborted at once). A decode leg failing
before its first item is the decode node's, unless the prefill leg fails too within
``BLAME_GRACE_S``: a decode leg waiting at a room nobody fills fails because of its prefill leg.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, Protocol

from prefixgate.gateway.nodeclient.base import NodeFailure, TokenDelta
from prefixgate.gateway.nodeclient.handoff.legs import BLAME_GRACE_S, DecodeLeg, PrefillAnswer, PrefillLeg
from prefixgate.gateway.nodeclient.handoff.split import PairedHandoff, SplitStream

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default (smg's too)
# Rooms are uniform in [0, limit): the SMG gRPC field is int32, an HTTP body's an int64.
GRPC_ROOM_LIMIT = (1 << 31) - 1
HTTP_ROOM_LIMIT = (1 << 63) - 1


class BootstrapPair(Protocol):
    """A transport's two legs of one request, built for one bootstrap room. A pair whose decode
    leg answers in one message says so with a true ``whole_answer`` attribute (absent: it
    streams)."""

    @property
    def room_limit(self) -> int: ...

    async def legs(self, room: int) -> tuple[PrefillLeg, DecodeLeg]:
        """Both legs, not yet started (failures: NodeFailure naming the node and stage)."""
        ...


class BootstrapStream(SplitStream):
    """Both legs at once; the stream is the decode leg's."""

    def __init__(self, pair: BootstrapPair) -> None:
        super().__init__(whole_answer=bool(getattr(pair, "whole_answer", False)))
        self.pair = pair
        self._run: asyncio.Future[PrefillAnswer] | None = None
        self._began = 0.0

    async def _begin(self) -> TokenDelta:
        self._began = time.perf_counter()
        prefill, decode = await self.pair.legs(secrets.randbelow(self.pair.room_limit))
        run = self._run = self._start_prefill(prefill)
        run.add_done_callback(self._prefill_done)
        first = self._start_decode(decode)
        legs: set[asyncio.Future[Any]] = {first, run}
        await asyncio.wait(legs, return_when=asyncio.FIRST_COMPLETED)
        if not first.done() and run.exception() is not None:
            self._in_flight = False  # no hand-off happened: nothing is in flight to the decode node
            run.result()  # raises the prefill node's failure
        try:
            await asyncio.shield(first)
        except NodeFailure:
            await self._blame_prefill_first()
            raise
        answer = await asyncio.shield(run)
        if self.prefill is None:
            self._report(answer)
        delta = await anext(decode)
        self._take_cached()
        return delta

    def _prefill_done(self, run: asyncio.Future[PrefillAnswer]) -> None:
        if run.cancelled() or run.exception() is not None:
            return
        if self.prefill is None:
            # a whole answer's first item is its end: the prefill leg's end (its KV handed over) is
            # what times the prefill node then (``PrefillReport.prefill_s``)
            took = time.perf_counter() - self._began if self.whole_answer and self._began else 0.0
            self._report(run.result(), prefill_s=took)
        if self.whole_answer:
            # the prefill leg ends once the KV is handed over: nothing is in flight to the decode
            # leg, whose first item, the whole answer, comes only at its end
            self._in_flight = False

    async def _blame_prefill_first(self) -> None:
        """The decode leg failed before its first item: when the prefill leg fails too (within
        a short grace), that failure is the one raised."""
        run = self._run
        assert run is not None
        await asyncio.wait({run}, timeout=BLAME_GRACE_S)
        if run.done() and not run.cancelled() and run.exception() is not None:
            self._in_flight = False
            run.result()


class BootstrapHandoff(PairedHandoff[BootstrapPair]):
    """SGLang split serving over the transport whose pairs ``pair`` makes."""

    def stream(self, pair: BootstrapPair) -> BootstrapStream:
        return BootstrapStream(pair)
