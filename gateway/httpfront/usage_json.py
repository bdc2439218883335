"""The usage API's JSON (``GET /admin/usage``, ``GET /v1/usage``) for the ledger's typed report
(``gateway.core.usage``) and the rate limits' use (``gateway.core.rate_limits``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefixgate.gateway.core.rate_limits import LimitUse
from prefixgate.gateway.core.usage import Prices, UsageReport, Value
from prefixgate.gateway.state.store import UsageCounts


def counts_json(c: UsageCounts) -> dict[str, int]:
    return {
        "requests": c.requests,
        "prompt_tokens": c.prompt_tokens,
        "cached_tokens": c.cached_tokens,
        "computed_tokens": c.computed_tokens,
        "output_tokens": c.output_tokens,
    }


def value_json(v: Value) -> dict[str, float]:
    return asdict(v)


def prices_json(p: Prices) -> dict[str, Any]:
    return {
        "currency": p.currency,
        "per_million_tokens": {"input_miss": p.input_miss, "input_hit": p.input_hit, "output": p.output},
    }


def report_json(r: UsageReport) -> dict[str, Any]:
    return {
        "object": "usage",
        "tenant": r.tenant,
        "prices": prices_json(r.prices),
        "data": [
            {
                "tenant": row.tenant,
                "model": row.model,
                **counts_json(row.counts),
                "value": value_json(row.value),
            }
            for row in r.rows
        ],
        "totals": {**counts_json(r.totals), "value": value_json(r.value)},
    }


def limits_json(by_tenant: dict[str, list[LimitUse]]) -> list[dict[str, Any]]:
    """Per tenant, each limit in force (tenant's, then each API key's, by key id) and its use
    in the last minute, summed over every replica."""
    return [
        {
            "tenant": tenant,
            "window_seconds": 60,
            "data": [
                {
                    "scope": u.scope,
                    **({"key": u.key} if u.key else {}),
                    "unit": u.unit,
                    "limit": u.limit,
                    "used": u.used,
                    "setting": u.setting,
                }
                for u in uses
            ],
        }
        for tenant, uses in sorted(by_tenant.items())
    ]
