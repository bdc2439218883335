"""This node's leg of a PD pair over HTTP, both engines' ways (the legs' work is
``backends.pd``'s; here: which leg a body is, and each leg's answer as the HTTP face streams it).
The engines' own ways are in ``docs/engines.md``, sections "SGLang HTTP PD" and "vLLM HTTP PD
(NIXL proxy)"; ours, "The HTTP endpoint of our nodes".

- SGLang (sglang-router / smg ``--pd-disaggregation``): the router sends the same body, with
  ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``, to a prefill and a decode node
  at once. A prefill node waits for the room's decode leg, prefills and pushes, and answers with
  the first token; a decode node presents the room, receives the pages and streams the answer.
  With ``n``, choice ``i``'s legs meet at its own room (``PDRequest.rooms_for``).
- vLLM (NIXL proxy, vllm-router ``--vllm-pd-disaggregation``): the prefill request carries
  ``kv_transfer_params: {"do_remote_decode": true}``; the prefill node computes the prompt (its
  pages stay in its pool), opens a bootstrap room for it and answers with ``kv_transfer_params``
  naming it (``remote_host``, ``remote_port`` = its bootstrap port, ``bootstrap_room``,
  ``do_remote_prefill: true``). The decode request carries those params: the decode node
  presents the room and the prefill node pushes the (now cached) pages, as in SGLang's way.
  The decode leg reports the first prefill's cached tokens. One choice only (``n`` > 1: 400).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from prefixgate.backends.bootstrap import DEFAULT_BOOTSTRAP_TIMEOUT_S, BootstrapServer
from prefixgate.backends.choices import Gen, Started, nothing_after, start_all
from prefixgate.backends.engine import Sampling
from prefixgate.backends.errors import FailedPrecondition
from prefixgate.backends.generation import Chunk, Generation
from prefixgate.backends.http_requests import PDRequest, Prompt
from prefixgate.backends.node import Node, PrefillCall, PrefillResult
from prefixgate.backends.pd import Relay, Room, hand_off, meet_prefill
from prefixgate.openai.errors import invalid


@dataclass(frozen=True, slots=True)
class PDLink:
    """What the HTTP endpoint needs for split serving: where this node takes KV pages (its gRPC
    address, for ``TransferKV``), its bootstrap listener (a prefill node) and the host it gives
    decode nodes to reach that listener."""

    kv_address: Callable[[], str]
    bootstrap: BootstrapServer | None = None
    advertise_host: str = "127.0.0.1"
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S


def prefill_chunk(r: PrefillResult) -> Chunk:
    """A prefill leg's whole answer: its first token, finishing it."""
    c = Chunk(
        [r.first_token],
        r.first_text,
        r.finish_reason or "length",
        r.prompt_tokens,
        1,
        r.cached_tokens,
        r.queue_seconds,
        r.prefill_seconds,
    )
    if r.first_logprob is not None:
        c.logprobs = [r.first_logprob]
    return c


def _answered(r: PrefillResult) -> Started:
    chunk = prefill_chunk(r)
    return nothing_after(chunk), chunk


async def _setting(event: asyncio.Event, work: Awaitable[PrefillResult]) -> PrefillResult:
    """``work``, then ``event`` set (whether it succeeded or not)."""
    try:
        return await work
    finally:
        event.set()


class HTTPLegs:
    """This node's legs of the PD pairs that reach its HTTP face."""

    def __init__(self, node: Node, link: PDLink) -> None:
        self.node = node
        self.link = link
        self.relay = Relay(node)  # vLLM-style prefills waiting for their decode leg

    async def close(self) -> None:
        await self.relay.close()

    async def start(
        self, pd: PDRequest, prompt: Prompt, choices: Sequence[Sampling]
    ) -> tuple[list[Started], dict[str, Any]]:
        """Start this node's leg of each choice (``choices``: each one's sampling); returns each
        choice's chunks and first chunk, and fields to add to the response (vLLM's
        ``kv_transfer_params``).

        SGLang's PD: choice ``i``'s legs meet at its own room on both nodes (``PDRequest.rooms_for``:
        the ``i``-th of the lists sglang-router sends, or ``bootstrap_room + i`` as SGLang's
        engines expand one room): the decode leg presents every room at once; the prefill leg takes
        them all, prefills choice 0's, then the others' (its blocks cached: only the last partial
        block is computed again), each choice its own first token and sampling state, pushed to the
        decode node (which keeps one copy of the shared blocks)."""
        role = self.node.config.role
        n = len(choices)
        if pd.leg != "sglang" and n > 1:
            raise invalid("'n' must be 1 with kv_transfer_params: vLLM's PD hands over one choice", "n")
        if pd.leg == "decode" or (pd.leg == "sglang" and role == "decode"):
            rooms = pd.rooms_for(n)
            return await start_all([self._decode_leg(r, s) for r, s in zip(rooms, choices, strict=True)]), {}
        bootstrap = self._bootstrap()
        if pd.leg == "sglang":
            computed = asyncio.Event()
            legs = [
                hand_off(self.node, bootstrap, r.room, self._call(prompt, s), after=computed if i else None)
                for i, (r, s) in enumerate(zip(pd.rooms_for(n), choices, strict=True))
            ]
            results = await start_all([_setting(computed, legs[0]), *legs[1:]])
            return [_answered(r) for r in results], {}
        # vLLM: compute now, keep the pages, hand them to whichever decode node presents the room.
        r, room = await self.relay.prefill(bootstrap, self._call(prompt, choices[0]))
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.node.node_id,
            "remote_block_ids": [],
            "remote_host": self.link.advertise_host,
            "remote_port": bootstrap.port,
            "bootstrap_room": room,
            "tp_size": 1,
        }
        return [_answered(r)], {"kv_transfer_params": params}

    @staticmethod
    def _call(prompt: Prompt, sampling: Sampling) -> PrefillCall:
        return PrefillCall(uuid.uuid4().hex, prompt.tokens, prompt.hashes, sampling)

    def _bootstrap(self) -> BootstrapServer:
        if self.link.bootstrap is None:
            raise FailedPrecondition(
                "this node has no bootstrap port (--bootstrap-port): it cannot prefill for PD"
            )
        return self.link.bootstrap

    async def _decode_leg(self, room: Room, sampling: Sampling) -> Started:
        """Present ``room`` to the prefill node, take the pages, decode here."""
        link = self.link
        handed = await meet_prefill(room, "", link.kv_address(), link.bootstrap_timeout_s)
        cached = handed.cached_tokens
        chunks = cast(Gen, self.node.decode(handed.kv_handle, sampling))
        token, text = handed.first_token, handed.first_text
        if text is None:  # a prefill leg that does not send it
            e = self.node.engine
            text = Generation(sampling, e.eos_token, e.token_text).push([token])[1]
        first = Chunk([token], text, "", handed.prompt_tokens, 1, cached)
        if handed.first_logprob is not None and sampling.logprobs:
            first.logprobs = [handed.first_logprob]

        async def leg() -> Gen:
            try:
                async for c in chunks:
                    c.cached_tokens = cached
                    yield c
            finally:
                await chunks.aclose()

        return leg(), first
