"""Tenants' and API keys' tokens and requests per minute, on the shared state store.

A client's request reserves, once prepared (its prompt tokens and effective ``max_tokens``
known), the prompt plus the most it may generate (``n`` choices of ``max_tokens``) on every
counter it counts against, and one request on the request counters, all or none; it settles
when it ends, however it ends, with what it used (prompt + completion tokens: one that failed
before generating gives its output part back). The admin's own requests are not limited.

Over a limit: 429 ``rate_limit_exceeded`` naming the limit and its setting, with Retry-After
(whole seconds, rounded up). A request whose cost is above a limit itself can never be
admitted: a 400 (``param: max_tokens``), so the client changes the request instead of
retrying it (OpenAI's client retries a 429 by itself).

When the store (Redis) fails, requests are let through: a limit protects capacity, and a
gateway that refused all traffic while Redis was away would turn a Redis outage into an outage
of the API. Each such request counts in ``prefixgate_rate_limit_store_failures_total``, and a
warning is logged once per outage. Settling runs in the background, off the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.errors import InvalidRequest, RateLimited
from prefixgate.gateway.core.request import Credentials, Prepared
from prefixgate.gateway.scheduling.limit_policy import (
    Limit,
    LimitPolicy,
    Pair,
    parse_tenant_limits,
    refusal_message,
    retry_seconds,
)
from prefixgate.gateway.scheduling.token_limits import Granted
from prefixgate.gateway.state.store import StateStore

log = structlog.get_logger("prefixgate.limits")

MAX_TENANT_LABELS = 1_000


def policy_of(settings: Settings) -> LimitPolicy:
    s = settings
    return LimitPolicy(
        Pair(s.tenant_tokens_per_minute, s.tenant_requests_per_minute),
        Pair(s.key_tokens_per_minute, s.key_requests_per_minute),
        parse_tenant_limits(s.tenant_limits),
        keyless=not s.api_keys,
    )


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(slots=True)
class Hold:
    """A request's reservation: what to settle, and in which bucket (None: nothing reserved)."""

    tenant: str
    bucket: int | None = None
    tokens: int = 0  # reserved on the token counters
    token_counters: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LimitUse:
    """One limit of a tenant (or of one of its keys) and its use in the window now."""

    scope: str
    unit: str
    limit: int
    setting: str
    used: int
    key: str = ""


class RateLimiter:
    def __init__(
        self,
        state: StateStore,
        policy: LimitPolicy,
        registry: CollectorRegistry,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self.state = state
        self.policy = policy
        self.clock = clock
        self._failing = False
        self._settling: set[asyncio.Task[None]] = set()
        self._labels: set[str] = set()
        self.m_refused = Counter(
            "prefixgate_rate_limit_refusals",
            "Requests refused by a rate limit, by tenant and limit "
            "(tenant_tpm, tenant_rpm, key_tpm, key_rpm)",
            ["tenant", "limit"],
            registry=registry,
        )
        self.m_used = Gauge(
            "prefixgate_rate_limit_window_used",
            "A tenant's use of its limit in the last minute, as of its last request through this replica",
            ["tenant", "limit"],
            multiprocess_mode="mostrecent",  # gateway workers share the window (the state store)
            registry=registry,
        )
        self.m_failures = Counter(
            "prefixgate_rate_limit_store_failures",
            "Requests let through unchecked because the state store (Redis) failed",
            registry=registry,
        )

    @property
    def active(self) -> bool:
        return self.policy.active

    def _label(self, tenant: str) -> str:
        if tenant in self._labels or len(self._labels) < MAX_TENANT_LABELS:
            self._labels.add(tenant)
            return tenant
        return "_other"

    async def reserve(self, prep: Prepared, output_tokens: int) -> Hold:
        """Reserve the request on its counters, or raise ``RateLimited`` (429) / ``InvalidRequest``."""
        ctx = prep.context
        hold = Hold(ctx.tenant)
        if ctx.credentials is Credentials.ADMIN or not self.policy.active:
            return hold
        cost = prep.prompt_tokens + output_tokens
        pairs = self.policy.checks(ctx.tenant, ctx.key_id, cost)
        if not pairs:
            return hold
        checks = [c for c, _ in pairs]
        try:
            out = await self.state.limit_reserve(ctx.tenant, checks, self.clock())
        except Exception as e:
            self.m_failures.inc()
            if not self._failing:
                self._failing = True
                log.warning("rate_limits_unchecked", reason="state store failed", error=repr(e)[:200])
            return hold
        if self._failing:
            self._failing = False
            log.info("rate_limits_checked_again")
        label = self._label(ctx.tenant)
        if isinstance(out, Granted):
            for (_, lim), used in zip(pairs, out.used, strict=True):
                if lim.scope == "tenant":
                    self.m_used.labels(label, lim.label).set(used)
            hold.bucket = out.bucket
            hold.tokens = cost
            hold.token_counters = [c.counter for c, lim in pairs if lim.unit == "tokens"]
            return hold
        check, lim = pairs[out.index]
        self.m_refused.labels(label, lim.label).inc()
        message = refusal_message(ctx.tenant, ctx.key_id, lim, check.cost, out.used, out.retry_after_ms)
        if out.retry_after_ms is None:
            param = prep.max_tokens_param or ("max_tokens" if output_tokens else prep.prompt_param)
            raise InvalidRequest(message, param=param, code="exceeds_rate_limit")
        raise RateLimited(message, retry_after=float(retry_seconds(out.retry_after_ms)))

    def settle(self, hold: Hold, used_tokens: int) -> None:
        """Give back (or charge) the difference between what was reserved and what was used;
        in the background, so a cancelled request settles all the same."""
        if hold.bucket is None or not hold.token_counters or used_tokens == hold.tokens:
            return
        delta = used_tokens - hold.tokens
        deltas = [(c, delta) for c in hold.token_counters]
        task = asyncio.get_running_loop().create_task(self._settle(hold, deltas))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, hold: Hold, deltas: list[tuple[str, int]]) -> None:
        assert hold.bucket is not None
        try:
            await self.state.limit_settle(hold.tenant, deltas, hold.bucket, self.clock())
        except Exception as e:  # the reservation then holds until it leaves the window
            log.warning("rate_limit_settle_failed", tenant=hold.tenant, error=repr(e)[:200])

    async def drain(self) -> None:
        """Wait for the settlements under way (tests, shutdown)."""
        while self._settling:
            await asyncio.gather(*list(self._settling), return_exceptions=True)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.drain(), 2.0)

    async def use(self, tenant: str, key_ids: list[str]) -> list[LimitUse]:
        """The tenant's limits (and its keys') with their use in the window now."""
        rows: list[tuple[Limit, str, str]] = []
        for lim, counter in zip(self.policy.tenant_limits(tenant), ("tpm", "rpm"), strict=True):
            if lim.value > 0:
                rows.append((lim, counter, ""))
        for key_id in key_ids:
            for lim, unit in zip(self.policy.key_limits(), ("tpm", "rpm"), strict=True):
                if lim.value > 0:
                    rows.append((lim, f"k:{key_id}:{unit}", key_id))
        if not rows:
            return []
        used = await self.state.limit_used(tenant, [c for _, c, _ in rows], self.clock())
        return [
            LimitUse(lim.scope, lim.unit, lim.value, lim.setting, u, key)
            for (lim, _, key), u in zip(rows, used, strict=True)
        ]
