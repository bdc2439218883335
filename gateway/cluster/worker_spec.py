"""An smg worker body (``POST /workers``, a discovery file's entries) read as prefixgate's role,
address and ``WorkerOptions``: smg's ``WorkerConfigRequest`` and its newer ``WorkerSpec``
(``runtime_type``, ``connection_mode``, ``models``). What prefixgate does with each field is in
docs/admin.md ("smg's worker API"); a field it cannot honour is refused naming it, never dropped.
Pure: no I/O."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from prefixgate.gateway.cluster.workers import WorkerOptions
from prefixgate.gateway.core.errors import invalid
from prefixgate.gateway.vocab import Role

#: smg's worker types, as prefixgate's roles.
WORKER_TYPES = {"regular": Role.MONOLITHIC.value, "prefill": Role.PREFILL.value, "decode": Role.DECODE.value}
TYPE_OF_ROLE = {role: kind for kind, role in WORKER_TYPES.items()}
#: A role as configuration spells it: smg's worker types or prefixgate's roles.
ROLE_NAMES = {**WORKER_TYPES, **{r.value: r.value for r in Role}}
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


def parse_worker_body(body: Mapping[str, Any]) -> tuple[str, str, WorkerOptions]:
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
