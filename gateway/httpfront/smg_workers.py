"""smg's worker API (``POST /workers``, ``GET /workers``, ``GET /workers/{id}``, ``DELETE
/workers/{id}``) over the same membership as ``/admin/nodes``, behind the admin token: an smg
user's scripts that register and remove workers keep working (docs/admin.md, "smg's worker API").

A body is smg's ``WorkerConfigRequest`` or its newer ``WorkerSpec`` (``runtime_type``,
``connection_mode``, ``models``): what prefixgate does with a field is said in ``FIELDS``; a
field it cannot honour is refused (400, naming it and the gateway-wide setting that does the
job), never dropped. Registration is done before the answer (smg queues it and answers 202; so
do we, with the same body, the worker already in the pool).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.cluster.workers import NO_OPTIONS, WorkerOptions
from prefixgate.gateway.core.errors import Conflict, NotFound, invalid
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.admin import json_body, require_admin
from prefixgate.gateway.httpfront.common import ORJSONResponse, service_of
from prefixgate.gateway.vocab import Role

#: smg's worker types, as prefixgate's roles.
WORKER_TYPES = {"regular": Role.MONOLITHIC.value, "prefill": Role.PREFILL.value, "decode": Role.DECODE.value}
TYPE_OF_ROLE = {role: kind for kind, role in WORKER_TYPES.items()}
#: Runtimes prefixgate speaks to; "" (and smg's "unspecified"): detected (SMG protocol) or the
#: gateway's ``--backend``. ``external``: any OpenAI-compatible server (``http://`` only).
RUNTIMES = ("sglang", "vllm", "external", "unspecified", "")
#: Fields smg takes per worker that prefixgate sets once per gateway: refused when given.
GATEWAY_WIDE = {
    "tokenizer_path": "--tokenizer-path (one tokenizer per model, for the whole gateway)",
    "chat_template": "--tokenizer-path (the model's own template, beside its tokenizer)",
    "tool_parser": "--tool-call-parser",
    "reasoning_parser": "nothing: prefixgate passes the engine's reasoning text through as it comes",
    "health_check_timeout_secs": "--health-check-timeout-secs",
    "health_check_interval_secs": "--health-check-interval-secs (the status poll)",
    "health_success_threshold": "--health-success-threshold",
    "health_failure_threshold": "--health-failure-threshold",
    "health": "the gateway's --health-* flags",
    "max_connection_attempts": "nothing: a worker that does not answer is probed until it does",
    "dp_aware": "nothing: data-parallel ranks are one worker to prefixgate",
}
FIELDS = frozenset(
    {
        "url",
        "worker_type",
        "bootstrap_port",
        "runtime",
        "runtime_type",
        "connection_mode",
        "api_key",
        "model_id",
        "models",
        "priority",
        "cost",
        "labels",
        *GATEWAY_WIDE,
    }
)
_HOST = r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)"
_URL = re.compile(
    rf"^(?:(https?)://{_HOST}(:\d{{1,5}})?(/v1)?/?|grpc://{_HOST}:\d{{1,5}}|{_HOST}:\d{{1,5}})$"
)


def _worker(body: Mapping[str, Any]) -> tuple[str, str, WorkerOptions]:
    """(role, address, options) from an smg worker body; InvalidRequest names what is wrong."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise invalid(
            f"unknown field {unknown[0]!r}; the fields are: {', '.join(sorted(FIELDS))}", unknown[0]
        )
    for name, instead in GATEWAY_WIDE.items():
        if body.get(name) not in (None, False):
            raise invalid(f"'{name}' is not set per worker in prefixgate; use {instead}", name)
    url = body.get("url")
    if not isinstance(url, str) or not _URL.match(url):
        raise invalid(
            "'url' must be http://HOST[:PORT] (an OpenAI-compatible server), grpc://HOST:PORT "
            "(SGLang or vLLM over the SMG protocol) or HOST:PORT (a prefixgate node)",
            "url",
        )
    address = url.rstrip("/") if url.startswith("http") else url
    kind = body.get("worker_type") or "regular"
    if kind not in WORKER_TYPES:
        raise invalid(f"'worker_type' must be one of {', '.join(WORKER_TYPES)}", "worker_type")
    http = address.startswith(("http://", "https://"))
    grpc = address.startswith("grpc://")
    mode = body.get("connection_mode")
    if mode is not None and mode != ("grpc" if grpc else "http" if http else mode):
        raise invalid(f"'connection_mode' {mode!r} does not match the url {url!r}", "connection_mode")
    port = body.get("bootstrap_port")
    if port is not None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise invalid("'bootstrap_port' must be a port number (1-65535)", "bootstrap_port")
        if kind != "prefill":
            raise invalid("only a prefill worker takes a bootstrap port", "bootstrap_port")
    runtime = body.get("runtime") if body.get("runtime") is not None else body.get("runtime_type")
    runtime = "" if runtime is None else runtime
    if runtime not in RUNTIMES:
        raise invalid(
            f"runtime {runtime!r}: prefixgate speaks to sglang and vllm workers, and to any "
            "OpenAI-compatible server (external)",
            "runtime",
        )
    if runtime == "external" and not http:
        raise invalid("an external worker is an OpenAI-compatible http:// server", "runtime")
    if runtime == "external" and kind != "regular":
        raise invalid("an external worker serves whole requests: worker_type regular", "worker_type")
    api_key = body.get("api_key") or ""
    if not isinstance(api_key, str):
        raise invalid("'api_key' must be a string", "api_key")
    if api_key and not http:
        raise invalid("'api_key' is sent to http:// workers; the gRPC protocols carry none", "api_key")
    return WORKER_TYPES[kind], address, _options(body, kind, port, runtime, api_key)


def _options(
    body: Mapping[str, Any], kind: str, port: int | None, runtime: str, api_key: str
) -> WorkerOptions:
    model = body.get("model_id")
    models = body.get("models")
    if model is not None and not isinstance(model, str):
        raise invalid("'model_id' must be a string", "model_id")
    if models is not None:
        if not isinstance(models, list) or not all(
            isinstance(m, dict) and isinstance(m.get("id"), str) for m in models
        ):
            raise invalid("'models' must be a list of {\"id\": NAME} model cards", "models")
        if len(models) > 1:
            raise invalid("'models': one model per worker (its engine serves one)", "models")
        model = model or (models[0]["id"] if models else None)
    priority = body.get("priority", 50)
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise invalid("'priority' must be a whole number from 0", "priority")
    cost = body.get("cost", 1.0)
    if isinstance(cost, bool) or not isinstance(cost, int | float) or cost < 0:
        raise invalid("'cost' must be a number from 0", "cost")
    labels = body.get("labels") or {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise invalid("'labels' must be an object of strings", "labels")
    return WorkerOptions(
        split=kind != "regular",
        bootstrap_port=port,
        runtime="" if runtime in ("unspecified", "external") else runtime,
        api_key=api_key,
        model_id=model or "",
        priority=priority,
        cost=float(cost),
        labels=tuple(sorted(labels.items())),
    )


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
        port = next(
            (
                int(p)
                for u, _, p in (e.rpartition("=") for e in svc.settings.bootstrap_ports)
                if u == node.address
            ),
            None,
        )
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
    role, address, options = _worker(await json_body(request))
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
