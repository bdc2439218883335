"""This node's part of a PD pair, whatever protocol the request came in on (the SMG engine
protocol, SGLang's or vLLM's HTTP PD): written once, so every face splits a request the same way.

- Prefill leg (``hand_off``): wait at the bootstrap room for the decode leg that presents it,
  prefill, push the KV pages to that decode node, tell it the handle (``HandedOff``).
- Decode leg (``meet_prefill``): present the room to the prefill node and wait for the handle;
  the caller then decodes on it.
- vLLM's relay (``Relay``): the prefill request computes at once and answers with
  ``kv_transfer_params`` naming a fresh room; the decode request presents that room and the
  prefill node pushes the (now cached) pages, as in SGLang's way.

The meeting itself is ``backends.bootstrap``'s; the pages move over the node's own KV transfer.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from dataclasses import dataclass, replace
from typing import Any

import structlog

from prefixgate.backends.bootstrap import BootstrapServer, handshake
from prefixgate.backends.engine import TokenLogprob
from prefixgate.backends.errors import NodeError
from prefixgate.backends.node import Node, PrefillCall, PrefillResult

log = structlog.get_logger("prefixgate.node")


@dataclass(frozen=True, slots=True)
class Room:
    """A bootstrap room and the prefill node's listener that holds it."""

    host: str
    port: int
    room: int


def logprob_json(lp: TokenLogprob | None) -> list[Any] | None:
    """A first token's log probability as the bootstrap reply carries it (engine ids)."""
    return None if lp is None else [lp.token, lp.logprob, [[t, v] for t, v in lp.top]]


def logprob_of(raw: Any) -> TokenLogprob | None:
    """``logprob_json``'s value back (None: absent or malformed)."""
    try:
        token, value, top = raw
        return TokenLogprob(int(token), float(value), tuple((int(t), float(v)) for t, v in top))
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class HandedOff:
    """What the prefill leg tells the decode leg once the pages are on the decode node."""

    kv_handle: str
    first_token: int
    first_text: str | None  # None: a prefill leg that does not send it
    first_logprob: TokenLogprob | None  # when asked
    finished: bool
    finish_reason: str
    cached_tokens: int
    prompt_tokens: int
    transfer_seconds: float = 0.0
    transfer_bytes: int = 0

    @classmethod
    def of(cls, r: PrefillResult, cached_tokens: int | None = None) -> HandedOff:
        """``cached_tokens``: what to report instead of this prefill's own (vLLM's relay: the
        first prefill's, the second found everything cached)."""
        return cls(
            r.kv_handle,
            r.first_token,
            r.first_text,
            r.first_logprob,
            r.finished,
            r.finish_reason,
            r.cached_tokens if cached_tokens is None else cached_tokens,
            r.prompt_tokens,
            r.transfer_seconds,
            r.transfer_bytes,
        )

    def message(self) -> dict[str, Any]:
        return {
            "kv_handle": self.kv_handle,
            "first_token": self.first_token,
            "first_text": self.first_text,
            "first_logprob": logprob_json(self.first_logprob),
            "finished": self.finished,
            "finish_reason": self.finish_reason,
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "transfer_seconds": self.transfer_seconds,
            "transfer_bytes": self.transfer_bytes,
        }

    @classmethod
    def parse(cls, reply: dict[str, Any]) -> HandedOff:
        text = reply.get("first_text")
        return cls(
            kv_handle=str(reply["kv_handle"]),
            first_token=int(reply["first_token"]),
            first_text=text if isinstance(text, str) else None,
            first_logprob=logprob_of(reply.get("first_logprob")),
            finished=bool(reply.get("finished")),
            finish_reason=str(reply.get("finish_reason") or ""),
            cached_tokens=int(reply.get("cached_tokens") or 0),
            prompt_tokens=int(reply.get("prompt_tokens") or 0),
            transfer_seconds=float(reply.get("transfer_seconds") or 0.0),
            transfer_bytes=int(reply.get("transfer_bytes") or 0),
        )


async def hand_off(
    node: Node,
    bootstrap: BootstrapServer,
    room: int,
    call: PrefillCall,
    *,
    leg_id: str = "",
    cached_tokens: int | None = None,
    after: asyncio.Event | None = None,
) -> PrefillResult:
    """The prefill leg: wait for the decode leg presenting ``room`` (``leg_id``: the request id
    both legs carry, checked; empty: they carry none), prefill ``call`` (``after``: once that is
    set, when another leg computes the shared blocks first), push the pages to that decode node,
    tell it the handle. A failure is told to the decode leg too."""
    peer = await bootstrap.wait_decode(room, leg_id)
    call = replace(call, decode_address=peer.kv_address)
    try:
        if after is not None:
            await after.wait()
        r = await node.prefill(call)
    except NodeError as e:
        peer.reply({"error": e.message, "code": e.code.name})
        raise
    except BaseException:
        peer.reply({"error": "prefill leg aborted", "code": "ABORTED"})
        raise
    peer.reply(HandedOff.of(r, cached_tokens).message())
    log.debug("prefill leg handed off", transfer_s=round(r.transfer_seconds, 6), bytes=r.transfer_bytes)
    return r


async def meet_prefill(room: Room, leg_id: str, kv_address: str, timeout: float) -> HandedOff:
    """The decode leg: present ``room`` (pages to ``kv_address``, this node's KV transfer port)
    and wait for the prefill leg's handle (``bootstrap.handshake`` bounds the wait)."""
    return HandedOff.parse(await handshake(room.host, room.port, room.room, leg_id, kv_address, timeout))


class Relay:
    """vLLM's PD on a prefill node: prefills computed at once, parked until a decode leg
    presents their room (or the bootstrap timeout ends the wait)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._parked: set[asyncio.Task[PrefillResult]] = set()

    async def prefill(self, bootstrap: BootstrapServer, call: PrefillCall) -> tuple[PrefillResult, int]:
        """Compute ``call`` (its pages stay in this node's pool); returns the result and the room
        a decode leg presents to have them pushed."""
        r = await self.node.prefill(call)
        room = secrets.randbits(63)
        again = replace(call, request_id=uuid.uuid4().hex)
        task = asyncio.create_task(hand_off(self.node, bootstrap, room, again, cached_tokens=r.cached_tokens))
        self._parked.add(task)
        task.add_done_callback(self._done)
        return r, room

    def _done(self, task: asyncio.Task[PrefillResult]) -> None:
        self._parked.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("parked prefill ended without a decode leg", error=str(task.exception())[:200])

    async def close(self) -> None:
        tasks = list(self._parked)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
