"""Pins on nodes whose protocol cannot pin: keep the prefix warm by re-prefilling it.

An engine behind the SMG protocol has no pin and no per-block evict, only ``FlushCache``; its
prefix cache is an LRU. A pin there is kept by sending the pinned prompt again as a one-token
request (``max_tokens=1``) before the LRU would reach it: every re-prefill finds the prefix
cached (computes nothing but the last token) and makes its blocks the most recently used. A
prefill worker gets it as a PD request with the least busy decode node as the other leg (an
engine in prefill mode serves nothing else).

When is "before"? The gateway counts the prompt tokens each node computed (``Metrics.per_node``,
every request it routed there). A pin is due once the node computed ``headroom`` blocks since
the pin's last refresh: half of the node's capacity left to other traffic (its capacity less
every keep-warm prefix on it). Traffic the gateway does not see (another gateway, a direct
client) is covered by a refresh at least every ``MAX_INTERVAL_S``. What stays best effort: one
request larger than the headroom, arriving before the refresh, still pushes the prefix out (the
next refresh computes it again).

Bounded: at most ``MAX_PINS`` prefixes per gateway, at most ``RATE`` re-prefills a second in
all, each pin until its ``pin_seconds`` run out. Pure bookkeeping plus one background task per
gateway; the requests go through the node client like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.nodeclient import NodeFailure, Prompt, TokenStream
from prefixgate.gateway.vocab import FailureKind, Stage
from prefixgate.openai.exceptions import Overloaded
from prefixgate.openai.schema import Sampling

if TYPE_CHECKING:
    from prefixgate.gateway.core.service import GatewayService

log = structlog.get_logger("prefixgate.keepwarm")

MAX_PINS = 64  # keep-warm prefixes one gateway holds
RATE = 8.0  # re-prefills a second, all pins together
MAX_INTERVAL_S = 30.0  # a refresh at least this often (traffic the gateway does not see)
TICK_S = 0.05
REFRESH_TIMEOUT_S = 30.0


@dataclass(slots=True)
class Refresh:
    """What one re-prefill found: the prompt's tokens the node had cached."""

    cached_tokens: int
    prompt_tokens: int


def partner(svc: GatewayService, node: Node) -> Node | None:
    """The decode node a prefill worker's re-prefill goes with: an engine serving PD prefill
    (SGLang in prefill mode) takes a request only as one leg of a pair. The least busy one."""
    if node.role != "prefill" or node.client.handoff is None:
        return None
    decode = svc.pool.routable("decode")
    return min(decode, key=lambda n: (n.view().outstanding_requests, n.id)) if decode else None


async def reprefill(
    node: Node, tokens: bytes, hashes: tuple[int, ...], timeout: float, pair: Node | None = None
) -> Refresh:
    """The prompt as a one-token request on ``node`` (with ``pair`` as the decode leg when it is
    a prefill worker); raises ``NodeFailure``."""
    prompt = Prompt(f"keepwarm-{uuid.uuid4().hex[:16]}", tokens, hashes, Sampling(max_tokens=1))
    handoff = node.client.handoff
    stream: TokenStream
    if pair is not None and handoff is not None:
        stream = handoff.start(prompt, node.client, pair.client, timeout=timeout)
    else:
        stream = node.client.generate(prompt, timeout=timeout)
    try:
        async with asyncio.timeout(timeout):
            async for delta in stream:
                if delta.finish_reason:
                    break
    except TimeoutError:
        detail = "keep-warm request timed out"
        raise NodeFailure(node.id, Stage.GENERATE, FailureKind.TIMEOUT, detail) from None
    finally:
        await stream.aclose()
    return Refresh(stream.cached_tokens, len(tokens) // 4)


@dataclass(slots=True)
class Pin:
    node: Node
    tokens: bytes
    hashes: tuple[int, ...]
    until: float  # time.monotonic()
    refreshed_at: float
    computed_at_refresh: int  # the node's computed tokens at the last refresh
    refreshes: int = 0
    failures: int = 0


class KeepWarm:
    """One gateway's keep-warm pins and the task that refreshes them."""

    def __init__(self, svc: GatewayService) -> None:
        self._svc = weakref.ref(svc)
        self.pins: dict[tuple[str, bytes], Pin] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_refresh = 0.0

    def computed(self, node: Node) -> int:
        svc = self._svc()
        counts = svc.metrics.per_node.get(node.id) if svc is not None else None
        return counts.computed if counts is not None else 0

    def headroom_blocks(self, node: Node) -> int:
        """Blocks the node may compute between two refreshes of a pin on it."""
        svc = self._svc()
        bs = svc.settings.block_size if svc is not None else 64
        capacity = node.status.capacity_blocks if node.status is not None else 0
        held = sum(len(p.tokens) // 4 // bs + 1 for p in self.pins.values() if p.node is node)
        return max(1, (capacity - held) // 2)

    def add(self, node: Node, tokens: bytes, hashes: tuple[int, ...], seconds: float) -> float:
        """Keep ``tokens`` warm on ``node`` for ``seconds`` (again: the pin is extended); returns
        the unix time it ends. Raises ``Overloaded`` when the gateway holds ``MAX_PINS``."""
        key = (node.id, tokens)
        now = time.monotonic()
        pin = self.pins.get(key)
        if pin is None:
            if len(self.pins) >= MAX_PINS:
                raise Overloaded(
                    f"this gateway keeps {MAX_PINS} prefixes warm already; let one expire", retry_after=60
                )
            pin = self.pins[key] = Pin(node, tokens, hashes, now + seconds, now, self.computed(node))
        pin.until = max(pin.until, now + seconds)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return time.time() + (pin.until - now)

    def due(self, pin: Pin, now: float) -> bool:
        svc = self._svc()
        bs = svc.settings.block_size if svc is not None else 64
        grown = (self.computed(pin.node) - pin.computed_at_refresh) // bs
        return now - pin.refreshed_at >= MAX_INTERVAL_S or grown >= self.headroom_blocks(pin.node)

    async def _run(self) -> None:
        """Until no pin is left: refresh the most overdue pin, at most ``RATE`` a second."""
        while self.pins:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            svc = self._svc()
            for key in [k for k, p in self.pins.items() if p.until <= now or not self._serving(svc, p)]:
                del self.pins[key]
            due = [p for p in self.pins.values() if self.due(p, now)]
            if not due or now - self._last_refresh < 1.0 / RATE:
                continue
            pin = min(due, key=lambda p: p.refreshed_at)
            self._last_refresh = now
            await self.refresh(pin)

    @staticmethod
    def _serving(svc: GatewayService | None, pin: Pin) -> bool:
        """The pin's node is still the pool's (a removed node's pins go with it)."""
        return svc is not None and svc.pool.by_id(pin.node.id) is pin.node

    def drop_node(self, node_id: str) -> int:
        """Forget the pins on a node (its cache was flushed on purpose); how many there were."""
        keys = [k for k in self.pins if k[0] == node_id]
        for k in keys:
            del self.pins[k]
        return len(keys)

    async def refresh(self, pin: Pin) -> None:
        before = self.computed(pin.node)
        svc = self._svc()
        pair = partner(svc, pin.node) if svc is not None else None
        try:
            r = await reprefill(pin.node, pin.tokens, pin.hashes, REFRESH_TIMEOUT_S, pair)
        except NodeFailure as e:
            pin.failures += 1
            pin.refreshed_at = time.monotonic()  # retried at the next due time, not at once
            log.warning("keepwarm_failed", node=pin.node.id, kind=e.kind.value, detail=e.detail[:200])
            return
        pin.refreshes += 1
        pin.refreshed_at = time.monotonic()
        # Its own tokens are not other traffic (the re-prefill is not counted by the pipeline).
        pin.computed_at_refresh = max(before, self.computed(pin.node))
        log.debug("keepwarm_refreshed", node=pin.node.id, cached=r.cached_tokens, prompt=r.prompt_tokens)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        self.pins.clear()


_KEEPERS: weakref.WeakKeyDictionary[GatewayService, KeepWarm] = weakref.WeakKeyDictionary()


def keeper(svc: GatewayService) -> KeepWarm:
    """The gateway's keep-warm pins (made on first use)."""
    k = _KEEPERS.get(svc)
    if k is None:
        k = _KEEPERS[svc] = KeepWarm(svc)
    return k
