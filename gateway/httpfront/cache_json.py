"""The admin API's JSON for the cache operations (``gateway.core.cache_ops``): block hashes
as 16 hex digits both ways, and the typed results of explain, evict and warm as answers."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefixgate.gateway.core.cache_ops import Explanation, NodeEviction, NodeMatch, WarmReport
from prefixgate.gateway.core.errors import InvalidRequest
from prefixgate.gateway.routing.base import Estimate

MAX_LISTED_HASHES = 1024  # block hashes listed per node in an eviction answer


def hex_hash(h: int) -> str:
    return f"{h:016x}"


def parse_hash(value: Any, param: str) -> int:
    """A block hash as 16 hex digits (optionally 0x-prefixed) or a non-negative integer."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64:
        return value
    if isinstance(value, str):
        text = value.lower().removeprefix("0x")
        if 0 < len(text) <= 16:
            try:
                return int(text, 16)
            except ValueError:
                pass
    raise InvalidRequest(
        "a block hash is 16 hex digits (as /admin/cache/lookup shows) or an integer", param=param
    )


def _estimate_json(e: Estimate | None) -> dict[str, Any]:
    if e is None:
        return {}
    return {
        "estimated_ttft_ms": round(e.ttft_s * 1000, 3),
        "queue_ms": round(e.queue_s * 1000, 3),
        "prefill_ms": round(e.prefill_s * 1000, 3),
        "transfer_ms": round(e.transfer_s * 1000, 3),
        "within_load_bound": e.within_bound,
    }


def _node_json(row: NodeMatch) -> dict[str, Any]:
    return {
        "id": row.id,
        "role": row.role,
        "routable": row.routable,
        "cache": row.cache,
        "hit_blocks": row.hit_blocks,
        "cached_tokens": row.cached_tokens,
        "max_context_tokens": row.max_context_tokens,
        "holds_request": row.holds,
        "load": {
            "outstanding_requests": row.outstanding_requests,
            "outstanding_tokens": row.outstanding_tokens,
            "active_streams": row.active_streams,
        },
        **_estimate_json(row.estimate),
        "chosen_for": row.chosen_for,
    }


def explanation_json(x: Explanation) -> dict[str, Any]:
    """``POST /admin/cache/lookup``'s answer."""
    prep, sw = x.prep, x.switches
    segments = [
        {
            "kind": s.kind,
            "label": s.label,
            "tokens": list(s.tokens),
            "token_count": s.tokens[1] - s.tokens[0],
            "blocks": list(s.blocks),
            "cached_tokens": s.cached_tokens,
        }
        for s in x.segments
    ]
    return {
        "object": "cache.lookup",
        "model": prep.model,
        "tenant": prep.tenant,
        "prompt_tokens": prep.prompt_tokens,
        "block_size": x.block_size,
        "full_blocks": len(prep.hashes),
        "switches": {
            "disaggregation": sw.disaggregation,
            "prefix_routing": sw.prefix_routing,
            "normalization": sw.normalization,
        },
        "layout": {"segments": segments},
        "block_hashes": [hex_hash(h) for h in prep.hashes],
        "prompt_basis": asdict(x.basis),
        "nodes": [_node_json(row) for row in x.nodes],
        "decision": asdict(x.decision),
        "scheduler": asdict(x.scheduler) if x.scheduler is not None else None,
    }


def eviction_json(r: NodeEviction) -> dict[str, Any]:
    """One node's part of ``POST /admin/cache/evict``'s answer."""
    return {
        "action": r.action,
        "evicted_blocks": len(r.evicted),
        "block_hashes": [hex_hash(h) for h in r.evicted[:MAX_LISTED_HASHES]],
        "truncated": len(r.evicted) > MAX_LISTED_HASHES,
        "index_removed": r.index_removed,
        "error": r.error,
    }


def warm_json(report: WarmReport) -> dict[str, Any]:
    """``POST /admin/cache/pin``'s and ``POST /v1/prefill``'s answer."""
    prep = report.prep
    return {
        "object": "prefill",
        "id": prep.request_id,
        "model": prep.model,
        "prompt_tokens": prep.prompt_tokens,
        "blocks": len(prep.hashes),
        "block_size": report.block_size,
        "pin_seconds": report.pin_seconds,
        "nodes": [asdict(r) for r in report.nodes],
    }
