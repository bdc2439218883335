"""smg's worker API (``POST /workers``, ``GET /workers``, ``GET /workers/{id}``, ``DELETE
/workers/{id}``) over the same membership as ``/admin/nodes``, behind the admin token: an smg
user's scripts that register and remove workers keep working (docs/admin.md, "smg's worker API").

A body is smg's ``WorkerConfigRequest`` or its newer ``WorkerSpec`` (``runtime_type``,
``connection_mode``, ``models``), read by ``cluster.worker_spec``: a field prefixgate cannot
honour is refused (400, naming it and the gateway-wide setting that does the job), never
dropped. Registration is done before the answer (smg queues it and answers 202; so do we, with
the same body, the worker already in the pool).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.cluster.worker_spec import TYPE_OF_ROLE, WORKER_TYPES, parse_worker_body
from prefixgate.gateway.cluster.workers import NO_OPTIONS, bootstrap_ports
from prefixgate.gateway.core.errors import Conflict, NotFound, invalid
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.admin import json_body, require_admin
from prefixgate.gateway.httpfront.common import ORJSONResponse, service_of


def worker_info(svc: GatewayService, node: Node) -> dict[str, Any]:
    """smg's ``WorkerInfo`` for one node (the API key never shown)."""
    extra = svc.worker_options.get(node.address, NO_OPTIONS)
    grpc = node.address.startswith("grpc://")
    runtime = extra.runtime or (svc.settings.backend if grpc or extra.split else "")
    info: dict[str, Any] = {
        "id": node.id,
        "url": node.address,
        "model_id": extra.model_id or (node.models[0] if node.models else ""),
        "models": [{"id": m} for m in node.models],
        "priority": extra.priority,
        "cost": extra.cost,
        "worker_type": TYPE_OF_ROLE.get(node.role, node.role),
        "is_healthy": node.healthy,
        "load": node.local_requests,
        "connection_mode": "grpc" if grpc or "://" not in node.address else "http",
        "metadata": dict(extra.labels),
        "draining": node.draining,
    }
    if runtime:
        info["runtime_type"] = runtime
    port = extra.bootstrap_port
    if port is None:
        port = bootstrap_ports(svc.settings).get(node.address)
    if port is not None:
        info["bootstrap_port"] = port
    return info


def _node(svc: GatewayService, worker_id: str) -> Node:
    node = svc.pool.by_id(worker_id)
    if node is None:
        raise NotFound(f"no worker {worker_id!r}", code="worker_not_found")
    return node


async def create_worker(request: Request) -> Response:
    svc = service_of(request)
    role, address, options = parse_worker_body(await json_body(request))
    if address in svc.pool.nodes:
        raise Conflict(f"worker {address} is already registered", param="url", code="worker_exists")
    try:
        node = await svc.add_node(role, address, options)
    except ValueError as e:  # a protocol that cannot take this role
        raise invalid(str(e), "worker_type") from None
    location = f"/workers/{node.id}"
    body = {
        "status": "accepted",
        "worker_id": node.id,
        "url": address,
        "location": location,
        "message": "Worker registered"
        + ("" if node.reachable else "; not answering yet, probed until it does"),
    }
    return ORJSONResponse(body, status_code=202, headers={"location": location})


async def list_workers(request: Request) -> Response:
    svc = service_of(request)
    infos = [worker_info(svc, n) for n in sorted(svc.pool.nodes.values(), key=lambda n: (n.role, n.id))]
    by_type = {kind: sum(1 for i in infos if i["worker_type"] == kind) for kind in WORKER_TYPES}
    stats = {
        "total_workers": len(infos),
        "healthy_workers": sum(1 for i in infos if i["is_healthy"]),
        "total_models": len({m["id"] for i in infos for m in i["models"]}),
        "total_load": sum(i["load"] for i in infos),
        "by_type": by_type,
    }
    return ORJSONResponse({"workers": infos, "total": len(infos), "stats": stats})


async def get_worker(request: Request) -> Response:
    svc = service_of(request)
    return ORJSONResponse(worker_info(svc, _node(svc, request.path_params["worker_id"])))


async def delete_worker(request: Request) -> Response:
    svc = service_of(request)
    node = _node(svc, request.path_params["worker_id"])
    await svc.remove_node(node)
    body = {"status": "accepted", "worker_id": node.id, "url": node.address, "message": "Worker removed"}
    return ORJSONResponse(body, status_code=202)


def smg_worker_routes() -> list[Route]:
    # ``path``: a grpc:// worker's id is its address, slashes included (smg's ids are URLs too)
    return [
        Route("/workers", require_admin(create_worker), methods=["POST"]),
        Route("/workers", require_admin(list_workers), methods=["GET"]),
        Route("/workers/{worker_id:path}", require_admin(get_worker), methods=["GET"]),
        Route("/workers/{worker_id:path}", require_admin(delete_worker), methods=["DELETE"]),
    ]
