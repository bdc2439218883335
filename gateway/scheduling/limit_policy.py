"""Which rate limits a request counts against, from the settings, and what a refusal says.

Tokens and requests per minute, per tenant (``tenant_tokens_per_minute``,
``tenant_requests_per_minute``, a tenant's own in ``tenant_limits``) and per API key
(``key_tokens_per_minute``, ``key_requests_per_minute``); 0 is no limit. Counters are named
within their tenant (``tpm``, ``rpm``, ``k:<key id>:tpm``, ``k:<key id>:rpm``) so a store can
keep a request's counters together. Pure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prefixgate.gateway.scheduling.token_limits import Check

_FIELD = re.compile(r"^(tpm|rpm)=(\d+)$")
KEYLESS_NAME = "default"  # how ``tenant_limits`` names the one tenant of keyless mode


@dataclass(frozen=True, slots=True)
class Pair:
    """Tokens and requests per minute (0: no limit)."""

    tpm: int = 0
    rpm: int = 0


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit of one request: what it counts, its value and the setting that gave it."""

    scope: str  # "tenant" or "key"
    unit: str  # "tokens" or "requests"
    value: int
    setting: str

    @property
    def label(self) -> str:
        """The metrics' ``limit`` label."""
        return f"{self.scope}_{'tpm' if self.unit == 'tokens' else 'rpm'}"


def parse_tenant_limits(entries: Iterable[str]) -> dict[str, Pair]:
    """``TENANT:tpm=N,rpm=N`` entries (either field may be left out). A list split at its
    commas (``PREFIXGATE_TENANT_LIMITS``) is joined back: a bare ``rpm=N`` continues the entry
    before it. Raises ValueError naming the entry."""
    joined: list[str] = []
    for raw in entries:
        entry = raw.strip()
        if _FIELD.match(entry) and joined:
            joined[-1] += "," + entry
        elif entry:
            joined.append(entry)
    out: dict[str, Pair] = {}
    for entry in joined:
        tenant, sep, rest = entry.rpartition(":")
        fields: dict[str, int] = {}
        for part in rest.split(","):
            m = _FIELD.match(part.strip())
            if not sep or not tenant or m is None or m.group(1) in fields:
                raise ValueError(
                    "setting 'tenant_limits': expected TENANT:tpm=N,rpm=N (either may be left out), "
                    f"got {entry!r}"
                )
            fields[m.group(1)] = int(m.group(2))
        if tenant in out:
            raise ValueError(f"setting 'tenant_limits': tenant {tenant!r} is given twice")
        out[tenant] = Pair(fields.get("tpm", -1), fields.get("rpm", -1))
    return out


@dataclass(frozen=True, slots=True)
class LimitPolicy:
    tenant: Pair = Pair()
    key: Pair = Pair()
    overrides: Mapping[str, Pair] = field(default_factory=dict)  # -1: the default
    keyless: bool = False  # without API keys: the keyless tenant is ``tenant_limits``' "default"

    @property
    def active(self) -> bool:
        pairs = [self.tenant, self.key, *self.overrides.values()]
        return any(p.tpm > 0 or p.rpm > 0 for p in pairs)

    def _override(self, tenant: str) -> Pair | None:
        name = KEYLESS_NAME if self.keyless and tenant == "" else tenant
        return self.overrides.get(name)

    def tenant_limits(self, tenant: str) -> tuple[Limit, Limit]:
        """The tenant's token and request limits (value 0: none)."""
        own = self._override(tenant)
        tpm = Limit("tenant", "tokens", self.tenant.tpm, "tenant_tokens_per_minute")
        rpm = Limit("tenant", "requests", self.tenant.rpm, "tenant_requests_per_minute")
        if own is not None and own.tpm >= 0:
            tpm = Limit("tenant", "tokens", own.tpm, "tenant_limits")
        if own is not None and own.rpm >= 0:
            rpm = Limit("tenant", "requests", own.rpm, "tenant_limits")
        return tpm, rpm

    def key_limits(self) -> tuple[Limit, Limit]:
        return (
            Limit("key", "tokens", self.key.tpm, "key_tokens_per_minute"),
            Limit("key", "requests", self.key.rpm, "key_requests_per_minute"),
        )

    def checks(self, tenant: str, key_id: str, tokens: int) -> list[tuple[Check, Limit]]:
        """The counters a request of ``tokens`` counts against (``key_id`` "": no key)."""
        out: list[tuple[Check, Limit]] = []
        tpm, rpm = self.tenant_limits(tenant)
        pairs = [("tpm", tpm), ("rpm", rpm)]
        if key_id:
            ktpm, krpm = self.key_limits()
            pairs += [(f"k:{key_id}:tpm", ktpm), (f"k:{key_id}:rpm", krpm)]
        for counter, lim in pairs:
            if lim.value > 0:
                out.append((Check(counter, lim.value, tokens if lim.unit == "tokens" else 1), lim))
        return out


def tenant_name(tenant: str) -> str:
    return tenant if tenant else f"{KEYLESS_NAME} (keyless)"


def retry_seconds(retry_after_ms: int) -> int:
    """Whole seconds, rounded up: retrying then finds the reservation fits."""
    return max(1, math.ceil(retry_after_ms / 1000))


def refusal_message(
    tenant: str, key_id: str, lim: Limit, cost: int, used: int, retry_after_ms: int | None
) -> str:
    who = f"tenant {tenant_name(tenant)}"
    if lim.scope == "key":
        who = f"API key {key_id} of {who}"
    head = f"{who}: {lim.value} {lim.unit} per minute ({lim.setting})"
    if lim.unit == "requests":
        need = f"{used} requests in the last minute"
    else:
        need = f"this request reserves {cost} tokens (prompt + max_tokens), {used} in use in the last minute"
    if retry_after_ms is None:
        return f"{head}; {need}: it can never fit; lower max_tokens or shorten the prompt"
    return f"{head}; {need}; retry after {retry_seconds(retry_after_ms)} s"
