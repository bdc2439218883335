"""The admin API (``/admin``): bearer admin token, or loopback clients only when none is set.

Also serves ``POST /v1/prefill`` (prefill-as-a-service, client auth): the same warm operation
as ``POST /admin/cache/pin``, for tenants. The operations live in ``gateway.core.cache_ops`` and
``GatewayService``; this module parses, authorizes and answers (their JSON:
``gateway.httpfront.cache_json``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from prefixgate.gateway.cluster import switches
from prefixgate.gateway.cluster.nodes import ROLES, Node
from prefixgate.gateway.config import KEYLESS_TENANT
from prefixgate.gateway.core import cache_ops
from prefixgate.gateway.core.auth import check_admin
from prefixgate.gateway.core.errors import Conflict, Forbidden, NotFound, invalid
from prefixgate.gateway.core.pipeline import Prepared
from prefixgate.gateway.core.request import Credentials, RequestContext
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront import cache_json, usage_json
from prefixgate.gateway.httpfront.common import (
    Handler,
    ORJSONResponse,
    caller_of,
    guard,
    read_body,
    request_id_of,
    service_of,
)
from prefixgate.gateway.logging import current_request_id
from prefixgate.gateway.metrics import HitCounts
from prefixgate.gateway.scheduling.classes import PRIORITY_CLASS_HEADER, TTFT_SLO_HEADER, slo_ms
from prefixgate.openai.schema import ParsedRequest, parse_request

SWITCHES = switches.NAMES
ADMIN_BODY_LIMIT = 64 * 1024
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")
_HTTP_WORKER = re.compile(r"^https?://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}(/v1)?/?$")


def require_admin(handler: Handler) -> Handler:
    """The admin's routes: the admin token, or loopback clients when none is set."""

    async def wrapped(request: Request) -> Response:
        caller = caller_of(request)
        check_admin(service_of(request).settings.admin_token, caller.authorization, caller.client_host)
        return await handler(request)

    return guard(wrapped)


# -- request bodies ------------------------------------------------------------------------------


async def json_body(
    request: Request, limit: int = ADMIN_BODY_LIMIT, *, optional: bool = False
) -> dict[str, Any]:
    raw = await read_body(request, limit)
    if optional and not raw.strip():
        return {}
    return await service_of(request).runner.parse_body(raw)


def parse_completion(svc: GatewayService, body: Mapping[str, Any]) -> ParsedRequest:
    """A completion-shaped body (chat form with ``messages``, else prompt form), validated as
    the client API validates it; ``model`` defaults to the served model (the only one the
    workers serve, when they name theirs)."""
    s = svc.settings
    kind = "chat" if "messages" in body else "completion"
    if kind == "completion" and "prompt" not in body:
        raise invalid("give 'messages' (chat form) or 'prompt' (completion form)", "prompt")
    models = svc.models
    default = next(iter(models)) if len(models) == 1 else s.default_model
    return parse_request(
        {"model": default, **body},
        kind,
        models=models,
        default_max_tokens=s.default_max_tokens,
        max_tokens_limit=s.max_tokens_limit,
        max_documents=s.max_documents,
        max_messages=s.max_messages,
        max_content_parts=s.max_content_parts,
    )


def admin_tenant(body: Mapping[str, Any]) -> str:
    """The admin names the tenant (``tenant``); by default the keyless one (``user`` selects none)."""
    tenant = body.get("tenant")
    if tenant is not None:
        if not isinstance(tenant, str):
            raise invalid("'tenant' must be a string", "tenant")
        return tenant
    return KEYLESS_TENANT


async def _prepare(svc: GatewayService, body: Mapping[str, Any], context: RequestContext) -> Prepared:
    """The completion-shaped body prepared as the runner prepares a client's, for the tenant
    the admin names."""
    _parsed, prep = await svc.runner.prepare(
        lambda: parse_completion(svc, body), context.acting_for(admin_tenant(body))
    )
    return prep


def _admin_context(request: Request) -> RequestContext:
    """An admin lookup's context: the route's guard checked the admin; the body names the tenant,
    the scheduler's headers its class and target, as on a client's request."""
    request_id = current_request_id() or request_id_of(request) or ""
    return RequestContext(
        KEYLESS_TENANT,
        request_id,
        Credentials.ADMIN,
        priority_class=request.headers.get(PRIORITY_CLASS_HEADER, ""),
        ttft_slo_ms=slo_ms(request.headers.get(TTFT_SLO_HEADER, "")),
    )


def _nodes_param(body: Mapping[str, Any]) -> list[str] | int | None:
    nodes = body.get("nodes")
    if nodes is None:
        return None
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        if not 1 <= nodes <= 1024:
            raise invalid("'nodes' as a count must be between 1 and 1024", "nodes")
        return nodes
    if isinstance(nodes, list) and nodes and all(isinstance(n, str) for n in nodes):
        return list(nodes)
    raise invalid("'nodes' must be a count or a non-empty array of node ids", "nodes")


def _pin_seconds(
    body: Mapping[str, Any], *, required: bool, limit: float = cache_ops.MAX_PIN_SECONDS, setting: str = ""
) -> float:
    v = body.get("pin_seconds")
    if v is None:
        if required:
            raise invalid("'pin_seconds' is required: how long to keep the prefix pinned", "pin_seconds")
        return 0.0
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= limit:
        named = f" ({setting})" if setting else ""
        too_long = isinstance(v, int | float) and not isinstance(v, bool) and v > limit
        raise invalid(
            f"'pin_seconds' must be a number between 0 and {limit:g}{named}",
            "pin_seconds",
            code="pin_too_long" if too_long else None,
        )
    if required and v <= 0:
        raise invalid("'pin_seconds' must be positive to pin", "pin_seconds")
    return float(v)


def _node(svc: GatewayService, node_id: str) -> Node:
    node = svc.pool.by_id(node_id)
    if node is None:
        raise NotFound(f"no node {node_id!r}", code="node_not_found")
    return node


# -- views ---------------------------------------------------------------------------------------


def tenant_cache(svc: GatewayService, node: Node) -> str:
    """How the node's engine cache stands between tenants: ``salted`` (its protocol carries each
    tenant's salt into the cache key), ``shared`` (one cache for the gateway's several tenants,
    ``tenant_cache = "shared"``) or ``unsalted`` (no salt; one tenant namespace, nothing shared)."""
    if node.client.capabilities.tenant_salt:
        return "salted"
    return "shared" if svc.shares_tenant_cache(node) else "unsalted"


def node_json(node: Node, index_blocks: int | None = None, *, tenants: str = "salted") -> dict[str, Any]:
    """``tenants``: ``tenant_cache(svc, node)``."""
    st = node.status
    return {
        "id": node.id,
        "role": node.role,
        "address": node.address,
        "reachable": node.reachable,
        "healthy": node.healthy,
        "routable": node.routable,
        "draining": node.draining,
        "circuit": node.breaker.state,
        "circuit_opens": node.breaker.opens,
        "load": {
            "local_requests": node.local_requests,
            "active_streams": node.active_streams,
            "pending_streams": node.pending_streams,
            "queued_requests": st.queued_requests if st else 0,
            "queued_tokens": st.queued_tokens if st else 0,
            "running_requests": st.running_requests if st else 0,
        },
        "kv": {
            "capacity_blocks": st.capacity_blocks if st else 0,
            "used_blocks": st.used_blocks if st else 0,
            "pinned_blocks": st.pinned_blocks if st else 0,
            "evictable_blocks": st.evictable_blocks if st else 0,
            "index_blocks": index_blocks,
        },
        "engine": st.engine if st else None,
        "models": list(node.models),
        "max_context_tokens": node.max_context_tokens or None,
        "cache": cache_ops.cache_view(node),
        "tenant_cache": tenants,
        "profile": st.profile.name if st else None,
        "instance_id": node.instance_id or None,
        "slowness": round(node.slowness, 3),
        "stats_age_s": round(time.monotonic() - node.status_at, 3) if node.status_at else None,
        "last_error": node.last_error or None,
        "refused": node.refused or None,
    }


def _hits_json(c: HitCounts) -> dict[str, Any]:
    return {
        "requests": c.requests,
        "prompt_tokens": c.prompt,
        "cached_tokens": c.cached,
        "predicted_cached_tokens": c.predicted,
        "computed_tokens": c.computed,
        "hit_ratio_reported": round(c.ratio(c.cached), 4),
        "hit_ratio_predicted": round(c.ratio(c.predicted), 4),
    }


async def _index_blocks(svc: GatewayService) -> dict[str, int]:
    stats = await svc.index.stats()
    return {n: o.blocks for n, o in stats.nodes.items()}


async def list_nodes(request: Request) -> Response:
    svc = service_of(request)
    held = await _index_blocks(svc)
    nodes = sorted(svc.pool.nodes.values(), key=lambda n: (ROLES.index(n.role), n.id))
    data = [node_json(n, held.get(n.id, 0), tenants=tenant_cache(svc, n)) for n in nodes]
    return ORJSONResponse({"object": "list", "data": data})


async def add_node(request: Request) -> Response:
    svc = service_of(request)
    body = await json_body(request)
    role, address = body.get("role"), body.get("address")
    if role not in ROLES:
        raise invalid(f"'role' must be one of {list(ROLES)}", "role")
    if not isinstance(address, str) or not (_ADDRESS.match(address) or _HTTP_WORKER.match(address)):
        raise invalid(
            "'address' must be host:port of the node's gRPC server, or http://host:port of an "
            "OpenAI-compatible server",
            "address",
        )
    if address in svc.pool.nodes:
        raise Conflict(f"node {address} is already registered", param="address", code="node_exists")
    try:
        node = await svc.add_node(str(role), address)
    except ValueError as e:  # a protocol that cannot take this role
        raise invalid(str(e), "role") from None
    return ORJSONResponse(node_json(node, 0, tenants=tenant_cache(svc, node)), status_code=201)


async def remove_node(request: Request) -> Response:
    svc = service_of(request)
    node = _node(svc, request.path_params["node_id"])
    in_flight = node.active_streams + max(node.local_requests, node.pending_streams)  # one request, one count
    forgotten = await svc.remove_node(node)
    return ORJSONResponse(
        {
            "id": node.id,
            "address": node.address,
            "removed": True,
            "index_blocks_forgotten": forgotten,
            "cut_in_flight": in_flight,
        }
    )


async def drain_node(request: Request) -> Response:
    """Drained: no new work; what runs on the node finishes. ``{"drain": false}`` undoes it."""
    svc = service_of(request)
    node = _node(svc, request.path_params["node_id"])
    body = await json_body(request, optional=True)
    drain = body.get("drain", True)
    if not isinstance(drain, bool):
        raise invalid("'drain' must be true or false", "drain")
    await svc.drain_node(node, drain)
    held = await _index_blocks(svc)
    return ORJSONResponse(node_json(node, held.get(node.id, 0), tenants=tenant_cache(svc, node)))


async def cache_view(request: Request) -> Response:
    svc = service_of(request)
    stats = await svc.index.stats()
    hits, totals = svc.metrics.hit_counts()  # every worker's
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for node in sorted(svc.pool.nodes.values(), key=lambda n: (ROLES.index(n.role), n.id)):
        seen.add(node.id)
        st = node.status
        occ = stats.nodes.get(node.id)
        cap = st.capacity_blocks if st else 0
        used = st.used_blocks if st else 0
        rows.append(
            {
                "id": node.id,
                "role": node.role,
                "index_blocks": occ.blocks if occ else 0,
                "capacity_blocks": cap,
                "used_blocks": used,
                "pinned_blocks": st.pinned_blocks if st else 0,
                "evictable_blocks": st.evictable_blocks if st else 0,
                "occupancy": round(used / cap, 4) if cap else 0.0,
                "node_hit_ratio": round(st.prefix_hit_tokens / st.prompt_tokens, 4)
                if st and st.prompt_tokens
                else 0.0,
                **_hits_json(hits.get(node.id, HitCounts())),
            }
        )
    for name, occ in sorted(stats.nodes.items()):  # blocks in the index of a node no longer in the pool
        if name not in seen and occ.blocks:
            rows.append(
                {"id": name, "role": None, "index_blocks": occ.blocks, "capacity_blocks": occ.capacity}
            )
    return ORJSONResponse(
        {
            "object": "cache",
            "index": {
                "backend": stats.backend,
                "total_blocks": stats.total_blocks,
                "degraded": stats.degraded,
            },
            "block_size": svc.settings.block_size,
            "totals": _hits_json(totals),
            "nodes": rows,
        }
    )


async def cache_lookup(request: Request) -> Response:
    svc = service_of(request)
    body = await json_body(request, svc.settings.max_body_bytes)
    prep = await _prepare(svc, body, _admin_context(request))
    return ORJSONResponse(cache_json.explanation_json(await cache_ops.explain(svc, prep)))


async def cache_evict(request: Request) -> Response:
    svc = service_of(request)
    body = await json_body(request, svc.settings.max_body_bytes)
    node_id = body.get("node")
    if node_id is not None and not isinstance(node_id, str):
        raise invalid("'node' must be a node id", "node")
    everything = body.get("all", False)
    if not isinstance(everything, bool):
        raise invalid("'all' must be true or false", "all")
    hashes: list[int] = []
    if "prompt" in body or "messages" in body:
        hashes += (await _prepare(svc, body, _admin_context(request))).hashes
    raw = body.get("block_hashes")
    if raw is not None:
        if not isinstance(raw, list):
            raise invalid("'block_hashes' must be an array", "block_hashes")
        hashes += [cache_json.parse_hash(h, f"block_hashes[{i}]") for i, h in enumerate(raw)]
    if hashes and everything:
        raise invalid("give blocks (prompt, messages, block_hashes) or 'all', not both", "all")
    if not hashes and not everything:
        if node_id is None:
            raise invalid(
                "say what to evict: 'prompt'/'messages', 'block_hashes', 'all', or a 'node' to empty", "all"
            )
        everything = True  # a node alone: everything it holds
    nodes = [_node(svc, node_id)] if node_id is not None else list(svc.pool.nodes.values())
    results = await cache_ops.evict(svc, nodes, list(dict.fromkeys(hashes)), everything)
    return ORJSONResponse(
        {
            "object": "cache.evict",
            "requested_blocks": len(set(hashes)),
            "all": everything,
            "evicted_blocks": sum(len(r.evicted) for r in results),
            "nodes": {r.node: cache_json.eviction_json(r) for r in results},
        }
    )


async def cache_pin(request: Request) -> Response:
    """``POST /admin/cache/pin``: warm and pin a prefix on nodes the admin may name."""
    svc = service_of(request)
    context = svc.runner.enter(caller_of(request), Credentials.ADMIN)
    body = await json_body(request, svc.settings.max_body_bytes)
    prep = await _prepare(svc, body, context)
    pin_seconds = _pin_seconds(body, required=True)
    job = cache_ops.Warm(svc, _nodes_param(body), pin_seconds)
    async with svc.runner.run(prep, job) as report:
        return ORJSONResponse(cache_json.warm_json(report))


async def prefill_service(request: Request) -> Response:
    """``POST /v1/prefill``: warm (and optionally pin) a prompt or document set for a tenant."""
    svc = service_of(request)
    runner = svc.runner
    max_pin = min(svc.settings.pin_max_seconds, cache_ops.MAX_PIN_SECONDS)
    context = runner.enter(caller_of(request))
    body = await json_body(request, svc.settings.max_body_bytes)
    if body.get("nodes") is not None:
        raise Forbidden(
            "choosing nodes is for the admin API (POST /admin/cache/pin); a tenant's prefill goes "
            "to the node its requests are routed to",
            param="nodes",
            code="admin_only",
        )

    def parse() -> ParsedRequest:
        parsed = parse_completion(svc, body)
        parsed.pin_seconds = _pin_seconds(body, required=False, limit=max_pin, setting="pin_max_seconds")
        return parsed

    _parsed, prep = await runner.prepare(parse, context)
    pin_seconds = _pin_seconds(body, required=False, limit=max_pin)  # validated in parse
    async with runner.run(prep, cache_ops.Warm(svc, None, pin_seconds, tenant_quota=True)) as report:
        return ORJSONResponse(cache_json.warm_json(report))


async def get_switches(request: Request) -> Response:
    return ORJSONResponse(service_of(request).switches.values())


async def put_switches(request: Request) -> Response:
    svc = service_of(request)
    body = await json_body(request)
    unknown = set(body) - set(SWITCHES)
    if unknown:
        raise invalid(f"unknown switch(es) {sorted(unknown)}; known: {list(SWITCHES)}", sorted(unknown)[0])
    for name, value in body.items():
        if not isinstance(value, bool):
            raise invalid(f"switch '{name}' must be true or false", name)
    return ORJSONResponse(await svc.switches.change(body))  # every replica and worker follows


async def cache_pins(request: Request) -> Response:
    """``GET /admin/cache/pins[?tenant=T]``: what tenants hold pinned, per node, until when (every
    replica's pins: they share the store)."""
    svc = service_of(request)
    tenant = request.query_params.get("tenant")
    rows = await svc.pins.rows(tenant)
    return ORJSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "tenant": r.tenant,
                    "node": r.node,
                    "blocks": r.blocks,
                    "until": round(r.until, 3),
                    "first_expiry": round(r.first_expiry, 3),
                }
                for r in rows
            ],
        }
    )


async def usage_view(request: Request) -> Response:
    """``GET /admin/usage[?tenant=T]``: tokens and their value per tenant and model, summed over
    every replica."""
    svc = service_of(request)
    tenant = request.query_params.get("tenant")
    body = usage_json.report_json(await svc.usage.report(tenant))
    body["limits"] = usage_json.limits_json(await svc.limit_use(tenant))
    return ORJSONResponse(body)


async def tenant_usage(request: Request) -> Response:
    """``GET /v1/usage``: the caller's own tenant's figures, never another's."""
    svc = service_of(request)
    key_tenant = svc.runner.authenticate(caller_of(request))
    tenant = KEYLESS_TENANT if key_tenant is None else key_tenant
    body = usage_json.report_json(await svc.usage.report(tenant))
    body["limits"] = usage_json.limits_json(await svc.limit_use(tenant))
    return ORJSONResponse(body)


def admin_routes() -> list[Route]:
    """Every ``/admin`` route, and ``/v1/prefill`` (client auth) which shares their warm path."""
    return [
        Route("/admin/nodes", require_admin(list_nodes), methods=["GET"]),
        Route("/admin/nodes", require_admin(add_node), methods=["POST"]),
        # ``path``: a grpc:// worker's id is its address, slashes included (sent as is or encoded)
        Route("/admin/nodes/{node_id:path}/drain", require_admin(drain_node), methods=["POST"]),
        Route("/admin/nodes/{node_id:path}", require_admin(remove_node), methods=["DELETE"]),
        Route("/admin/cache", require_admin(cache_view), methods=["GET"]),
        Route("/admin/cache/lookup", require_admin(cache_lookup), methods=["POST"]),
        Route("/admin/cache/evict", require_admin(cache_evict), methods=["POST"]),
        Route("/admin/cache/pin", require_admin(cache_pin), methods=["POST"]),
        Route("/admin/switches", require_admin(get_switches), methods=["GET"]),
        Route("/admin/switches", require_admin(put_switches), methods=["PUT"]),
        Route("/admin/cache/pins", require_admin(cache_pins), methods=["GET"]),
        Route("/admin/usage", require_admin(usage_view), methods=["GET"]),
        Route("/v1/prefill", guard(prefill_service), methods=["POST"]),
        Route("/v1/usage", guard(tenant_usage), methods=["GET"]),
    ]
