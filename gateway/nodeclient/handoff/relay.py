"""vLLM's sequential relay, for every transport (docs/engines.md, vLLM PD: kv_transfer_params
relay).

The prefill leg runs first, to its end (one length-capped token, not streamed, asked to keep the
KV for a remote decode); the transfer parameters of its answer go with the decode leg, sent
after it under the same request id. Whether an answer without parameters still gets a decode
leg (the engine recomputes the prompt) is the transport's to say: it answers None or fails the
prefill leg. The prefill leg's duration is its report's ``prefill_s``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from prefixgate.gateway.nodeclient.base import TokenDelta
from prefixgate.gateway.nodeclient.handoff.legs import DecodeLeg, PrefillAnswer, PrefillLeg
from prefixgate.gateway.nodeclient.handoff.split import PairedHandoff, SplitStream


class RelayPair(Protocol):
    """A transport's legs of one relayed request."""

    async def prefill_leg(self) -> PrefillLeg:
        """The prefill leg, not yet started (failures: NodeFailure naming the node and stage)."""
        ...

    def decode_leg(self, answer: PrefillAnswer) -> DecodeLeg:
        """The decode leg carrying ``answer``'s transfer parameters, not yet started."""
        ...


class RelayStream(SplitStream):
    """Prefill leg to its end, then the decode leg with its transfer parameters."""

    def __init__(self, pair: RelayPair) -> None:
        super().__init__()
        self.pair = pair
        self.relayed = False  # the decode leg got transfer parameters

    async def _begin(self) -> TokenDelta:
        prefill = await self.pair.prefill_leg()
        t0 = time.perf_counter()
        answer = await asyncio.shield(self._start_prefill(prefill))
        self._report(answer, time.perf_counter() - t0)
        self.relayed = answer.transfer_params is not None
        decode = self.pair.decode_leg(answer)
        await asyncio.shield(self._start_decode(decode))
        delta = await anext(decode)
        self._take_cached()
        return delta


class RelayHandoff(PairedHandoff[RelayPair]):
    """vLLM split serving over the transport whose pairs ``pair`` makes."""

    def stream(self, pair: RelayPair) -> RelayStream:
        return RelayStream(pair)
