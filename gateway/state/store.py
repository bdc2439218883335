"""State every gateway replica must agree on, behind one small storage protocol.

What a client or an operator changes through one replica must hold on every other: registered
documents, tenants' pins (with their expiry, for the pin quotas), node membership changes made
through the admin API, tenant usage and the rate limits' counters. ``StateStore`` is that storage, with two
implementations: ``MemoryState`` (one process, the embedded default, ``gateway.state.memory``)
and ``RedisState`` (single Redis or Redis Cluster, ``gateway.state.redis_store``), which pass the same
tests. The registries above it (documents, pins, membership, usage) hold the policy; the store
holds the data and makes each change atomic.

Times here are wall-clock seconds (``time.time()``): replicas compare them with each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prefixgate.gateway.scheduling.token_limits import Check, Outcome
from prefixgate.gateway.state.documents import DocumentLimits
from prefixgate.gateway.state.quotas import PinLimits


@dataclass(frozen=True, slots=True)
class DocumentUsage:
    documents: int
    bytes: int


@dataclass(slots=True)
class PinHold:
    """A tenant's pin as reserved: each node's entries before it, to give back a pin that failed."""

    tenant: str
    until: float = 0.0
    before: dict[str, dict[int, float | None]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PinRow:
    """What one tenant holds pinned on one node now."""

    tenant: str
    node: str
    blocks: int
    until: float  # the last of its pins there ends then
    first_expiry: float  # the first ends then


@dataclass(frozen=True, slots=True)
class Member:
    """A membership change made through the admin API: the node at ``address`` is (or is no
    longer) part of the deployment, drained or not."""

    address: str
    role: str
    present: bool
    draining: bool = False
    at: float = 0.0
    # a worker registered with options (``workers.WorkerOptions.to_record``); {}: none
    options: Mapping[str, Any] = field(default_factory=dict)


USAGE_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "output_tokens")


@dataclass(slots=True)
class UsageCounts:
    """One tenant's figures for one model (tokens as the engines reported them)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    def add(self, other: UsageCounts) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.output_tokens += other.output_tokens

    def values(self) -> tuple[int, int, int, int]:
        return (self.requests, self.prompt_tokens, self.cached_tokens, self.output_tokens)


UsageKey = tuple[str, str]  # (tenant, model)


class StateStore(Protocol):
    """Shared state of a deployment. Every method is one atomic change or one consistent read.

    Quota and bound violations raise the domain errors of ``prefixgate.gateway.core.errors``.
    """

    backend: str

    # Documents: per tenant, under ``DocumentLimits``; ``cost`` is ``documents.stored_cost``.
    async def doc_put(
        self, tenant: str, doc_id: str, text: str, cost: int, limits: DocumentLimits
    ) -> None: ...
    async def doc_get(self, tenant: str, doc_ids: Sequence[str]) -> list[str | None]: ...
    async def doc_delete(self, tenant: str, doc_id: str) -> bool: ...
    async def doc_usage(self, tenant: str) -> DocumentUsage: ...

    # Tenants' pins: reserved against ``PinLimits`` (node id -> KV capacity in blocks, 0 unknown).
    async def pin_reserve(
        self,
        tenant: str,
        capacities: Mapping[str, int],
        hashes: Sequence[int],
        seconds: float,
        now: float,
        limits: PinLimits,
    ) -> PinHold: ...
    async def pin_cancel(self, hold: PinHold, node_id: str) -> None: ...
    async def pins(self, tenant: str | None, now: float) -> list[PinRow]: ...

    # Membership changes made through the admin API.
    async def member_put(self, member: Member) -> None: ...
    async def members(self) -> list[Member]: ...

    # The runtime switches as last set through the admin API (name -> on), with the wall-clock
    # time of that change; None when none was made.
    async def switches_put(self, values: Mapping[str, bool], at: float) -> None: ...
    async def switches_get(self) -> tuple[dict[str, bool], float] | None: ...

    # Usage: counters added (summed across replicas), read per tenant (None: every tenant).
    async def usage_add(self, batch: Mapping[UsageKey, UsageCounts]) -> None: ...
    async def usage(self, tenant: str | None) -> dict[UsageKey, UsageCounts]: ...

    # Rate limits (``gateway.scheduling.token_limits``): a tenant's counters, reserved all or
    # none, settled in the bucket they were reserved in; ``now_ms`` is the caller's wall clock.
    async def limit_reserve(self, tenant: str, checks: Sequence[Check], now_ms: int) -> Outcome: ...
    async def limit_settle(
        self, tenant: str, deltas: Sequence[tuple[str, int]], bucket: int, now_ms: int
    ) -> None: ...
    async def limit_used(self, tenant: str, counters: Sequence[str], now_ms: int) -> list[int]: ...

    async def close(self) -> None: ...
