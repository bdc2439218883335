"""The legs of a split request, as a transport carries them, and the one rule for ending them.

A handoff (``bootstrap``, ``relay``) drives two legs: the prefill leg runs to its end and
answers what the decode leg needs (``PrefillAnswer``); the decode leg streams the output. A
transport (SMG gRPC, HTTP) supplies legs that send what an engine dialect built; it decides
nothing about the order of the legs, their blame, or when they are ended.

The abort rule (docs/engines.md, Aborts): a prefill leg is aborted at once; a
decode leg that has not yet produced its first item while a KV transfer to it may be in flight
is aborted only once that first item comes (or the leg ends), at most
``DEFERRED_ABORT_MAX_WAIT_S`` later: aborting an engine in the middle of a transfer can wedge
it. ``close_decode`` is that rule, for every transport.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from prefixgate.gateway.nodeclient.base import TokenDelta

DEFERRED_ABORT_MAX_WAIT_S = 30.0  # a decode leg is aborted only after its first item, at most this late
BLAME_GRACE_S = 0.3  # a failed decode leg waits this long for its prefill leg's own verdict


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    """What a finished prefill leg says: the prefix it reused (None: not reported) and, in a
    relay, the transfer parameters the decode leg gets (None: none came back)."""

    cached_tokens: int | None
    transfer_params: Any = None


class PrefillLeg(Protocol):
    """The prefill side of one split request."""

    @property
    def node_id(self) -> str: ...

    def start(self) -> asyncio.Future[PrefillAnswer]:
        """Send the request; the leg's own task, running the leg to its end (failures are the
        prefill node's, stage PREFILL)."""
        ...

    async def abort(self) -> None:
        """End the leg now if it still runs (idempotent, never raises)."""
        ...


class DecodeLeg(Protocol):
    """The decode side of one split request: started, its first item awaited, then streamed."""

    @property
    def cached_tokens(self) -> int:
        """The decode engine's own count of cached prompt tokens, as it reports it."""
        ...

    @property
    def node_id(self) -> str: ...

    @property
    def rid(self) -> str:
        """The engine's id of the request (both legs of a split share it)."""
        ...

    def start(self) -> asyncio.Future[None]:
        """Send the request; the leg's own task, done when its first item has come (failures
        are the decode node's, stage DECODE; ending before any item is one)."""
        ...

    def __aiter__(self) -> AsyncIterator[TokenDelta]: ...

    async def __anext__(self) -> TokenDelta:
        """The next delta (after ``start``'s task is done): the first item's, then the rest."""
        ...

    async def abort(self) -> None:
        """End the leg now if it still runs (idempotent, never raises)."""
        ...


_waiting: set[asyncio.Task[None]] = set()  # deferred aborts, kept until they are done


async def close_decode(leg: DecodeLeg, first: asyncio.Future[None] | None, *, in_flight: bool) -> None:
    """End a decode leg by the abort rule: at once, unless its first item is still to come
    while a transfer to it may be ``in_flight``; then once that item comes (or the leg fails),
    in the background, at most ``DEFERRED_ABORT_MAX_WAIT_S`` later."""
    if first is None or first.done() or not in_flight:
        await leg.abort()
        return
    task = asyncio.ensure_future(_abort_after_first(leg, first))
    _waiting.add(task)
    task.add_done_callback(_waiting.discard)


async def _abort_after_first(leg: DecodeLeg, first: asyncio.Future[None]) -> None:
    with contextlib.suppress(Exception, asyncio.CancelledError):
        async with asyncio.timeout(DEFERRED_ABORT_MAX_WAIT_S):
            await asyncio.shield(first)
    await leg.abort()


def retrieved(task: asyncio.Future[Any]) -> None:
    """A leg's failure after the request's end (or superseded by another) is no news."""
    if not task.cancelled():
        task.exception()
