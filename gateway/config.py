"""Gateway settings: defaults < TOML file < ``PREFIXGATE_*`` environment < command-line flags."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from prefixgate.gateway.cluster import workers
from prefixgate.gateway.core.tenancy import TENANT_CACHE_MODES, Tenancy
from prefixgate.gateway.nodeclient.openai_body import ENGINE_PRIORITY
from prefixgate.gateway.routing import parse_policy

ENV_PREFIX = "PREFIXGATE_"
# The model name of nodes that name none (our own protocol's nodes), unless ``model`` is set.
DEFAULT_MODEL = "prefixgate-sim"
# Without API keys nobody is authenticated, so there is one tenant: every client shares its
# documents, cache namespace and quotas, whatever ``user`` it sends.
KEYLESS_TENANT = ""
# The tenant of an API key given without ``=TENANT``: not the key itself, which would then show
# in metrics labels, usage reports and the admin API.
BARE_KEY_TENANT = "default"


@dataclass(slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 0  # 0: no gRPC front end; ``prefixgate up`` picks a free port
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    monolithic: list[str] = field(default_factory=list)
    # Engine KV events over ZMQ, per worker: "WORKER_ADDR=tcp://H:P[?replay=tcp://H:Q&topic=T]"
    # (gateway.nodeclient.zmq_events); those workers' index entries come from their publisher.
    kv_events: list[str] = field(default_factory=list)
    # smg-style workers (gateway/cluster/workers.py): ``worker_urls`` joins the monolithic pool; a prefill
    # entry may be "URL BOOTSTRAP_PORT"; ``backend`` fixes the grpc:// runtime (else detected).
    worker_urls: list[str] = field(default_factory=list)
    bootstrap_ports: list[str] = field(default_factory=list)  # "URL=PORT"
    backend: str = ""
    # Whether ``http://`` workers' engines are sent each request's ``priority`` (their OpenAI
    # bodies' field): "off" never (a default vLLM or SGLang ignores it, an SGLang run with
    # --abort-on-priority-when-disabled refuses it); "on" always, as is (lower first: vLLM run
    # with --scheduling-policy priority, SGLang with --enable-priority-scheduling
    # --schedule-low-priority-values-first); "inverted" always, negated (SGLang run with
    # --enable-priority-scheduling alone, where higher values go first). docs/engines.md.
    engine_priority: str = "off"
    # Gateway processes on one port (gateway.ops.supervisor, docs/workers.md); 0: one per core
    # the process may use. 1 by default while the admin switches and cache view are per worker.
    workers: int = 1
    redis: str = ""  # empty: embedded in-memory index (with several workers, a private store)
    redis_prefix: str = "prefixgate:"
    redis_layout: str = "zset"  # index key layout: zset (fastest writes) or packed (~6x less memory)
    # Models are what the engines name (``served_model_name``, else ``model_path``). ``model`` is
    # optional: the name of nodes that name none (default ``DEFAULT_MODEL``), and an alias of the
    # one model the engines name when they all name the same one.
    model: str = ""
    # "" (auto): the engine's tokenizer wherever token ids cross the wire (``grpc://`` workers),
    # else ``bytes4``. ``engine`` | ``engine:DIR`` | ``hf:DIR/tokenizer.json`` (= ``engine:DIR``)
    # | ``bytes4`` (refused in front of ``grpc://`` workers: they take the model's ids).
    tokenizer: str = ""
    # The engine's own tokenizer (gateway.tokens): a local directory, else the workers' bundle,
    # kept under tokenizer_cache_dir (default $XDG_CACHE_HOME/prefixgate/tokenizers).
    tokenizer_path: str = ""
    # "MODEL=DIR": the tokenizer of one model's workers where it is not ``tokenizer_path``'s (set
    # at start from the workers, or given): one tokenizer per model behind one gateway.
    model_tokenizers: list[str] = field(default_factory=list)
    tokenizer_cache_dir: str = ""
    tokenizer_timeout_s: float = 60.0
    tokenizer_worker_paths: bool = True  # use a worker's reported tokenizer_path when it exists here
    tokenizer_segment_cache_bytes: int = 64 * 1024 * 1024
    # Child processes per engine tokenizer that tokenize long uncached text (gateway.tokenpool),
    # started at the first long prompt; 0: the gateway's own threads tokenize everything.
    tokenizer_processes: int = 2
    # A small chat (body under 16 KiB) is rendered and tokenized on the event loop within this
    # budget (gateway.core.runner); three in a row over it send every later one to a render
    # thread. 0: every chat a template renders is prepared on a render thread.
    inline_render_budget_ms: float = 5.0
    # Tool calls in the model's text -> OpenAI tool_calls (gateway.toolcalls), for engines the
    # gateway tokenizes for: hermes | qwen25 | llama3 | mistral | pythonic; "" reads it from the
    # chat template when that is unambiguous; "none" turns tool calling off.
    tool_call_parser: str = ""
    block_size: int = 64
    # A policy spec, ``name`` or ``name:key=value,...`` (``prefixgate:affinity=5``), as ``bench
    # replay --policies`` takes it; ``load_factor`` is the default of the policies that take one.
    policy: str = "prefixgate"
    load_factor: float = 1.25
    # Bounds.
    max_body_bytes: int = 8 * 1024 * 1024
    max_prompt_tokens: int = 131_072
    context_window: int = 139_264
    default_max_tokens: int = 256
    max_tokens_limit: int = 8_192
    max_inflight: int = 512
    max_documents: int = 256
    # Checked before any per-message work, by both front ends (the gRPC front end also takes
    # ``max_body_bytes`` as its largest message).
    max_messages: int = 4096
    max_content_parts: int = 16_384
    max_json_values: int = 131_072  # a JSON body's values in all (its parsing cost)
    request_timeout_s: float = 300.0
    # Pipeline.
    # Serve monolithic when the best monolithic node would compute fewer uncached tokens than
    # this (0: never; the split keeps prefill work off the decode nodes).
    min_disagg_tokens: int = 0
    ttft_budget_s: float = 30.0  # estimated prefill queue wait beyond this: fall back
    stats_interval_s: float = 0.5
    # The gateway-held queue (gateway.scheduling): a node is given another prefill only while it
    # holds fewer than scheduler_node_requests that its speed says are done within
    # scheduler_window_s (0 requests: no queue, every request sent at once); the rest wait here,
    # at most scheduler_queue_requests / _bytes / scheduler_max_wait_s, and leave by priority
    # band, fair share between tenants (scheduler_quantum_tokens a turn), then shortest predicted
    # prefill first (rank = arrival + scheduler_shortest_first x predicted seconds, deferred at
    # most scheduler_max_defer_s) or deadline; a band waiting scheduler_promote_after_s goes first.
    scheduler_node_requests: int = 8
    scheduler_window_s: float = 0.05
    scheduler_queue_requests: int = 1024
    scheduler_queue_bytes: int = 256 * 1024 * 1024
    scheduler_max_wait_s: float = 30.0
    scheduler_quantum_tokens: int = 8192
    scheduler_shortest_first: float = 8.0
    scheduler_max_defer_s: float = 4.0
    scheduler_promote_after_s: float = 10.0
    # Priority classes, "NAME:priority=P;ttft_slo_ms=MS;sheddable" (gateway.scheduling.classes);
    # a request names one with the x-prefixgate-priority-class header ("default" otherwise).
    priority_classes: list[str] = field(default_factory=list)
    # Count a prefix as held by the node it was routed to while its prefill runs, before the
    # index shows it (gateway.routing.inflight): requests sharing it follow it there.
    inflight_prefixes: bool = True
    # An attempt's prefill (split) or first token (whole) must be done within what the gateway
    # predicts for it on its node (queue, uncached prefill, transfer: gateway.routing.deadline)
    # times the margin, at least the floor (margin 0: no prediction); every first token within
    # first_token_timeout_s, the limit too when the node's speed is unknown (0: the request
    # deadline only). Past its limit the next node is tried. Once streaming, a node silent
    # stall_timeout_s is given up on: the generation migrates (below; 0: no limit).
    first_token_deadline_margin: float = 3.0
    first_token_deadline_floor_s: float = 2.0
    first_token_timeout_s: float = 60.0
    stall_timeout_s: float = 30.0
    # A generation whose node fails after its first token continues on another node from the
    # tokens already sent (gateway.core.migration), at most this many times (0: never; past it,
    # the stream ends with an error event).
    max_migrations: int = 2
    # Retries before the first token: attempts per path (split, then monolithic; 1: no retry),
    # within ``request_timeout_s``; the pause before attempt k+1 is initial * multiplier^(k-1), at
    # most max, scaled by a random factor within jitter_factor of 1, plus up to jitter_s.
    retry_max_attempts: int = 3
    retry_backoff_initial_s: float = 0.02
    retry_backoff_max_s: float = 0.5
    retry_backoff_multiplier: float = 2.0
    retry_jitter_factor: float = 0.0
    retry_jitter_s: float = 0.05
    # Per-node circuit breaker (gateway.breaker): failed requests in a row that open it (0: never),
    # successful trials in a row that close it, and the wait before a trial (doubling after a
    # failed trial, up to the max).
    breaker_failure_threshold: int = 3
    breaker_success_threshold: int = 1
    breaker_cooldown_s: float = 1.0
    breaker_max_cooldown_s: float = 30.0
    # Health probes (the status poll, every ``stats_interval_s``; gateway.nodes): each bounded by
    # the timeout; failed probes in a row that open the breaker, passing ones that bring a node
    # that failed them back.
    health_check_timeout_s: float = 1.5
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    # Switches (also at runtime through the admin API).
    disaggregation: bool = True
    prefix_routing: bool = True
    normalization: bool = True
    response_headers: bool = True
    # Per-tenant quotas. Pins by tenants (``POST /v1/prefill``; admin pins are exempt): blocks
    # held pinned on one node, blocks held pinned on all nodes together, and the longest pin.
    pin_quota_blocks_per_node: int = 512
    pin_quota_node_share: float = 0.25  # and at most this share of a node's KV pool
    pin_quota_blocks: int = 1024
    pin_max_seconds: float = 3600.0
    # Registered documents: per tenant, and for the whole gateway; bytes are the memory a
    # document really takes in the gateway (text, id and bookkeeping), not its UTF-8 length.
    document_quota_count: int = 1000
    document_quota_bytes: int = 64 * 1024 * 1024
    document_store_bytes: int = 512 * 1024 * 1024
    # Rate limits over a sliding minute (gateway.core.rate_limits; 0: none): tokens (prompt +
    # max_tokens reserved when a request enters, settled to prompt + completion when it ends)
    # and requests, per tenant and per API key; shared by every replica with ``redis``.
    tenant_tokens_per_minute: int = 0
    tenant_requests_per_minute: int = 0
    key_tokens_per_minute: int = 0
    key_requests_per_minute: int = 0
    # A tenant's own: "TENANT:tpm=N,rpm=N" (either may be left out: the defaults above; the
    # keyless tenant is "default").
    tenant_limits: list[str] = field(default_factory=list)
    # Shared state (with ``redis``: documents, pins, membership changes and usage shared by every
    # replica). A tenant's documents expire this long after they were last registered or used;
    # membership records this long after the last replica stopped reading them; usage figures
    # this long after their last change.
    document_ttl_s: float = 7 * 24 * 3600.0
    membership_interval_s: float = 1.0  # how often a replica applies changes made elsewhere
    membership_ttl_s: float = 60.0
    # Workers found at run time (``gateway.cluster.discovery``): a file of smg worker bodies,
    # re-read when it changes; DNS names (``ROLE=NAME:PORT`` A/AAAA, ``ROLE=_svc._proto.NAME``
    # SRV), re-resolved; both every ``discovery_interval_s``. A worker gone from them is
    # forgotten, its index entries kept ``discovery_forget_s`` for it to come back.
    discovery_file: str = ""
    discovery_dns: list[str] = field(default_factory=list)
    discovery_dns_server: str = ""  # HOST[:PORT] of the resolver to ask ("": the system's)
    discovery_interval_s: float = 2.0
    discovery_forget_s: float = 300.0
    # Pods by label selector (``gateway.cluster.k8s_discovery``): ``ROLE=SELECTOR`` entries
    discovery_kubernetes: list[str] = field(default_factory=list)
    discovery_kubernetes_namespace: str = ""  # "": the gateway pod's own
    discovery_kubernetes_api: str = ""  # "": from inside the cluster (service account)
    discovery_kubernetes_scheme: str = "grpc"  # grpc (SGLang/vLLM) | http | prefixgate
    discovery_kubernetes_port: int = 8000  # a pod's port without a prefixgate.io/port annotation
    usage_flush_s: float = 1.0  # how often a replica adds its usage counts to the shared figures
    usage_ttl_s: float = 90 * 24 * 3600.0
    # Tenant accounting: prices per million tokens (defaults: the reference revenue model, input
    # 8 per million, a cache hit a quarter of that; it prices input only).
    price_input_miss: float = 8.0
    price_input_hit: float = 2.0
    price_output: float = 0.0
    price_currency: str = "CNY"
    # Auth: "key=tenant" entries; empty = no keys: one shared tenant, ``user`` selects nothing. A
    # bare "key" (smg's ``--api-key``) authenticates as the tenant ``BARE_KEY_TENANT``.
    api_keys: list[str] = field(default_factory=list)
    admin_token: str = ""
    shared_namespaces: list[str] = field(default_factory=list)  # tenants that share one cache
    # Workers whose protocol cannot keep tenants apart in the engine's prefix cache (``grpc://``):
    # "isolated" refuses them while the keys name several tenants; "shared" serves them with one
    # engine cache for all (a tenant's timing can tell what another sent before), never
    # reporting a tenant another's reuse (``gateway.core.tenancy``).
    tenant_cache: str = "isolated"
    # HTTP server limits (per connection, before any request reaches the app).
    header_timeout_s: float = 10.0  # from accept (or the previous response) to the end of the headers
    body_timeout_s: float = 60.0  # from the end of the headers to the end of the body
    keepalive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1024  # also held under the process's open-file limit
    max_header_bytes: int = 32 * 1024  # request line + headers; above: 431
    shutdown_grace_s: float = 10.0  # SIGTERM: streams still open after this end with an error event
    # gRPC server limits (gateway.grpcfront). It shares the HTTP ones that mean the same:
    # max_connections (accepted connections; beyond, refused at accept), keepalive_timeout_s
    # (a connection without a call this long is closed), header_timeout_s (the HTTP/2
    # handshake), max_header_bytes (metadata), max_body_bytes (a message), shutdown_grace_s.
    grpc_max_concurrent_streams: int = 100  # calls at once per connection; more wait on the client
    grpc_max_connection_age_s: float = 0.0  # 0: none; else a connection this old is told to go away
    grpc_keepalive_time_s: float = 60.0  # a connection silent this long is pinged...
    grpc_keepalive_timeout_s: float = 20.0  # ...and closed when the ping is not answered in this
    grpc_min_ping_interval_s: float = 10.0  # a client pinging more often (without calls) is sent away
    # HTTP access policy.
    trusted_proxies: list[str] = field(default_factory=list)  # peers whose Forwarded/X-*-IP are believed
    admin_origins: list[str] = field(default_factory=list)  # extra Origins allowed to call /admin
    metrics_token: str = ""  # bearer token for /metrics; empty: unauthenticated
    # A listener of its own serving /metrics alone (besides /metrics on ``port``); 0: none.
    # ``prometheus_host`` empty: ``host``.
    prometheus_port: int = 0
    prometheus_host: str = ""
    log_format: str = "auto"  # auto | json | console
    log_level: str = "info"

    @property
    def default_model(self) -> str:
        """The name of nodes that name no model."""
        return self.model or DEFAULT_MODEL

    def tenancy(self) -> Tenancy:
        """The tenants' cache namespaces and what may share an engine's cache (``gateway.core.tenancy``)."""
        return Tenancy.of(self.api_key_map().values(), self.shared_namespaces, self.tenant_cache)

    def api_key_map(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for entry in self.api_keys:
            key, tenant = split_api_key(entry)
            out[key] = tenant
        return out


def split_api_key(entry: str) -> tuple[str, str]:
    """A ``key=tenant`` entry as (key, tenant); a bare key's tenant is ``BARE_KEY_TENANT``."""
    key, eq, tenant = entry.partition("=")
    return key.strip(), (tenant.strip() if eq and tenant.strip() else BARE_KEY_TENANT)


def _coerce(name: str, hint: Any, raw: Any) -> Any:
    origin = getattr(hint, "__origin__", None)
    if origin is list:
        if isinstance(raw, str):
            return [p.strip() for p in raw.split(",") if p.strip()]
        if isinstance(raw, list):
            return [str(p) for p in raw]
    elif hint is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return raw.lower() in ("1", "true", "yes", "on")
    elif hint is int and not isinstance(raw, bool):
        return int(raw)
    elif hint is float and not isinstance(raw, bool):
        return float(raw)
    elif hint is str:
        return str(raw)
    raise ValueError(f"setting {name!r}: cannot use {raw!r}")


def load_settings(
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build settings from a TOML file, the environment and explicit overrides (flags)."""
    hints = get_type_hints(Settings)
    values: dict[str, Any] = {}
    env = os.environ if environ is None else environ
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        table = data.get("gateway", data)
        for key, raw in table.items():
            name = key.replace("-", "_")
            if name not in hints:
                raise ValueError(f"{path}: unknown setting {key!r}")
            values[name] = _coerce(name, hints[name], raw)
    for name, hint in hints.items():
        raw_env = env.get(ENV_PREFIX + name.upper())
        if raw_env is not None:
            values[name] = _coerce(name, hint, raw_env)
    for name, raw in (overrides or {}).items():
        if raw is None or (isinstance(raw, list) and not raw):
            continue
        if name not in hints:
            raise ValueError(f"unknown setting {name!r}")
        values[name] = _coerce(name, hints[name], raw)
    settings = workers.normalize(dataclasses.replace(Settings(), **values))
    try:
        parse_policy(settings.policy, {"load_factor": settings.load_factor})
    except ValueError as e:
        raise ValueError(f"setting 'policy': {e}") from None
    settings = _check_tokenizer(settings)
    _check_tool_call_parser(settings)
    _check_priority_classes(settings)
    _check_tenant_cache(settings)
    _check_bounds(settings)
    if settings.engine_priority not in ENGINE_PRIORITY:
        raise ValueError(
            f"setting 'engine_priority': {settings.engine_priority!r}: "
            f"use one of {', '.join(ENGINE_PRIORITY)}"
        )
    _check_tenant_limits(settings)
    return settings


# Settings that must be at least the given value (what a value below would mean is nonsense).
_AT_LEAST: dict[str, float] = {
    "retry_max_attempts": 1,
    "retry_backoff_initial_s": 0,
    "retry_backoff_max_s": 0,
    "retry_backoff_multiplier": 1,
    "retry_jitter_factor": 0,
    "retry_jitter_s": 0,
    "breaker_failure_threshold": 0,
    "breaker_success_threshold": 1,
    "breaker_cooldown_s": 0,
    "breaker_max_cooldown_s": 0,
    "health_check_timeout_s": 0.001,
    "health_failure_threshold": 1,
    "health_success_threshold": 1,
    "stats_interval_s": 0.001,
    "request_timeout_s": 0.001,
    "first_token_deadline_margin": 0,
    "first_token_deadline_floor_s": 0,
    "first_token_timeout_s": 0,
    "max_inflight": 1,
    "scheduler_node_requests": 0,
    "scheduler_window_s": 0,
    "scheduler_queue_requests": 0,
    "scheduler_queue_bytes": 0,
    "scheduler_max_wait_s": 0.001,
    "scheduler_quantum_tokens": 1,
    "scheduler_shortest_first": 0,
    "scheduler_max_defer_s": 0,
    "scheduler_promote_after_s": 0,
    "prometheus_port": 0,
    "workers": 0,
    "tokenizer_processes": 0,
    "inline_render_budget_ms": 0,
    "grpc_max_concurrent_streams": 1,
    "grpc_max_connection_age_s": 0,
    "grpc_keepalive_time_s": 0.001,
    "grpc_keepalive_timeout_s": 0.001,
    "grpc_min_ping_interval_s": 0,
    "discovery_interval_s": 0.05,
    "discovery_forget_s": 0,
    "tenant_tokens_per_minute": 0,
    "tenant_requests_per_minute": 0,
    "key_tokens_per_minute": 0,
    "key_requests_per_minute": 0,
}


#: More gateway processes than this is a typo, not a deployment (each holds its own pools).
MAX_WORKERS = 256


def _check_bounds(settings: Settings) -> None:
    for name, low in _AT_LEAST.items():
        value = getattr(settings, name)
        if not value >= low:
            raise ValueError(f"setting {name!r}: {value!r} is below {low:g}")
    if settings.workers > MAX_WORKERS:
        raise ValueError(f"setting 'workers': {settings.workers!r} is above {MAX_WORKERS}")
    if settings.retry_jitter_factor > 1:
        raise ValueError(f"setting 'retry_jitter_factor': {settings.retry_jitter_factor!r} is above 1")


def _check_tenant_limits(settings: Settings) -> None:
    """Each entry well-formed and naming a tenant there is: a typo would limit nobody."""
    from prefixgate.gateway.scheduling.limit_policy import KEYLESS_NAME, parse_tenant_limits

    known = set(settings.api_key_map().values()) or {KEYLESS_NAME}
    for tenant in parse_tenant_limits(settings.tenant_limits):
        if tenant not in known:
            raise ValueError(
                f"setting 'tenant_limits': tenant {tenant!r} is named by no API key "
                f"(tenants: {', '.join(sorted(known))})"
            )


def _check_tenant_cache(settings: Settings) -> None:
    for tenant in settings.api_key_map().values():  # a control character could forge a salt
        if not tenant.isprintable():
            raise ValueError(f"setting 'api_keys': tenant {tenant!r} has a control character")
    if settings.tenant_cache not in TENANT_CACHE_MODES:
        raise ValueError(
            f"setting 'tenant_cache': {settings.tenant_cache!r}: use one of {', '.join(TENANT_CACHE_MODES)}"
        )


def _check_priority_classes(settings: Settings) -> None:
    from prefixgate.gateway.scheduling.classes import class_table

    try:
        class_table(settings.priority_classes)
    except ValueError as e:
        raise ValueError(f"setting 'priority_classes': {e}") from None


def _check_tool_call_parser(settings: Settings) -> None:
    from prefixgate.gateway.toolcalls import PARSERS

    name = settings.tool_call_parser
    if name and name != "none" and name not in PARSERS:
        raise ValueError(f"setting 'tool_call_parser': {name!r}: use one of {', '.join(PARSERS)} or none")


def _check_tokenizer(settings: Settings) -> Settings:
    """A tokenizer spec or path that cannot work is a settings error, said before anything starts.

    ``hf:DIR/tokenizer.json`` means the same as ``--tokenizer-path DIR``: the model's tokenizer
    with its own chat template (the directory's ``tokenizer_config.json``), never the gateway's
    rendering in front of a model that has a template."""
    spec = settings.tokenizer
    if not (spec in ("", "bytes4", "engine") or spec.startswith(("hf:", "engine:"))):
        raise ValueError(
            f"setting 'tokenizer': {spec!r}: use bytes4, engine, engine:DIR or hf:DIR/tokenizer.json"
        )
    if spec.startswith("hf:"):
        file = Path(spec[3:]).expanduser()
        directory = file.parent if file.name == "tokenizer.json" else file
        settings = dataclasses.replace(settings, tokenizer="engine", tokenizer_path=str(directory))
    path = spec[len("engine:") :] if spec.startswith("engine:") else settings.tokenizer_path
    if path and not Path(path).expanduser().is_dir():
        raise ValueError(f"setting 'tokenizer_path': {path!r} is not a directory")
    for entry in settings.model_tokenizers:
        model, sep, tok_dir = entry.partition("=")
        if not sep or not model or not Path(tok_dir).expanduser().is_dir():
            raise ValueError(f"setting 'model_tokenizers': expected MODEL=DIR (a directory), got {entry!r}")
    if settings.tokenizer == "bytes4" and (ids := workers.id_workers(settings)):
        raise ValueError(
            f"setting 'tokenizer': bytes4 cannot feed {ids[0]}: grpc:// workers take the model's own "
            "token ids; leave the tokenizer unset (the workers' own is used) or pass --tokenizer-path DIR"
        )
    return settings
