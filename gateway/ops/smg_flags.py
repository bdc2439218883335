"""``smg launch`` command lines on ``prefixgate gateway`` (smg 1.13.0, the SGLang model gateway).

A user replaces ``smg launch`` with ``prefixgate gateway`` and keeps the flags. Every flag of
``smg launch`` is one of three kinds here:

- one ``prefixgate gateway`` already has with the same meaning (``SHARED``: ``--host``,
  ``--prefill``, ``--api-key`` ...), parsed by the gateway's own options;
- one taken and mapped onto settings (``TAKEN``, added by ``add_smg_arguments`` and turned into
  setting overrides by ``smg_overrides``);
- one refused (``REFUSED``): its first appearance ends the parse with one line naming it and
  saying why or what to use instead (``SmgFlagRefused``), exit status 2. Nothing is ignored.

The "smg launch flags" table of docs/settings.md says the same for users.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

SMG_VERSION = "1.13.0"

# smg's policy names -> ours (gateway.routing.registry), or None with what to use instead.
POLICY_MAP: dict[str, str | None] = {
    "cache_aware": "prefixgate",
    "round_robin": "round_robin",
    "random": "random",
    "power_of_two": "least_loaded",
    "least_load": "least_loaded",
    "prefix_hash": "consistent_hash",
}
POLICY_REFUSED: dict[str, str] = {
    "consistent_hashing": "hashes a routing-key header; prefixgate has no routing keys: use prefix_hash "
    "(consistent_hash) or cache_aware",
    "manual": "pins routing keys from request headers; prefixgate has no routing keys: use cache_aware",
    "passthrough": "hands the choice to an external picker; prefixgate chooses itself: use cache_aware",
    "bucket": "prefixgate has no bucket policy: use cache_aware (prefixgate's cache- and load-aware policy)",
}
# The decode node is always the least busy one that takes the prefill node's KV format.
DECODE_BY_LOAD = ("power_of_two", "least_load")

# smg flags `prefixgate gateway` has itself, with the same meaning (docs/settings.md, "smg launch flags").
SHARED: tuple[str, ...] = (
    "--host",
    "--port",
    "--worker-urls",
    "--prefill",
    "--decode",
    "--backend",
    "--policy",
    "--api-key",
    "--block-size",
    "--tokenizer-path",
    "--tool-call-parser",
    "--model",  # NB: in smg an alias of --model-path; here an optional model alias (config.Settings.model)
)


class SmgFlagRefused(Exception):
    """An smg flag (or value) prefixgate does not take; the message is the one line to print."""


def _refusal(flag: str, why: str) -> str:
    return f"{flag} is an smg flag prefixgate does not take ({why})"


class _Refuse(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        flag = option_string or self.option_strings[0]
        raise SmgFlagRefused(_refusal(flag, REFUSED[flag]))


_ROUTING = "a knob of smg's own routing; prefixgate routes by estimated time to first token, see --policy"
_OVERLOAD = (
    "prefixgate keeps a node out of routing from its own load cap (max_inflight and the planner's bound)"
)
_LIFECYCLE = "prefixgate polls each node for its status instead"
_ADMISSION = (
    "prefixgate admits up to --max-concurrent-requests (max_inflight), holds what no node can start in "
    "its own queue (--queue-size, --queue-timeout-secs; classes: priority_classes) and answers 429 beyond"
)
_MM = "prefixgate serves text; image parts are refused with a 400"
_DISCOVERY = (
    "prefixgate finds workers by DNS name (discovery_dns: a headless Service's pods) or in a file"
    " (discovery_file), not by label selector; or register them with POST /workers"
)
_HISTORY = "prefixgate stores no conversations or responses (no Responses API)"
_TLS = "prefixgate speaks plain HTTP and gRPC; put a TLS proxy in front, or use a mesh"
_AUTH = "prefixgate authenticates clients with --api-key KEY[=TENANT] and the admin API with --admin-token"
_MESH = "prefixgate replicas share state through --redis, not a mesh"
_TOKENIZER = "prefixgate tokenizes with --tokenizer-path DIR (the model's tokenizer.json and chat template)"
_PARSER = "prefixgate parses tool calls (--tool-call-parser) and passes reasoning text through"
_TENANCY = "prefixgate's tenant is the one its API key names (--api-key KEY=TENANT)"
_STICKY = "prefixgate has no sticky sessions; cache_aware follows a conversation's prefix"
_LOGS = "prefixgate logs to stderr (--log-format json|console)"
_TOKCACHE = "prefixgate caches tokenized segments itself (tokenizer_segment_cache_bytes)"
_STARTUP = "prefixgate starts at once and routes to a node from its first answered status poll"
_KEEP = "prefixgate keeps every node; a node that answers its probes again rejoins by itself"
_PREFIX = "prefixgate's consistent_hash is blind to load: use cache_aware for load-aware"

REFUSED: dict[str, str] = {
    "--upstream-http2": "prefixgate speaks HTTP/1.1 to http:// workers",
    "--upstream-pool-idle-timeout-secs": "prefixgate's pooled connections to workers are not tunable",
    "--health-check-port": "/healthz and /readyz are on the main port",
    "--encode-policy": "prefixgate has no encode stage (EPD)",
    "--cache-threshold": _ROUTING,
    "--cache-match-threshold": _ROUTING,
    "--prefix-token-count": "prefixgate's consistent_hash hashes the first block (--block-size tokens)",
    "--prefix-hash-load-factor": _PREFIX,
    "--prefix-hash-balance-abs-threshold": "prefixgate's consistent_hash is blind to load",
    "--least-load-kv-pressure-weight": _ROUTING,
    "--least-load-default-throughput": "prefixgate takes each node's prefill rate from its own status",
    "--least-load-mean-prefill-tokens": "prefixgate counts every request's prompt tokens before routing",
    "--least-load-max-waiting-requests": _OVERLOAD,
    "--power-of-two-load-metric": "prefixgate's least_loaded compares outstanding tokens, then requests",
    "--balance-abs-threshold": _ROUTING,
    "--spill-abs-threshold": _ROUTING,
    "--balance-rel-threshold": _ROUTING,
    "--spill-rel-threshold": _ROUTING,
    "--balance-token-usage-threshold": _ROUTING,
    "--overload-token-usage-threshold": _ROUTING,
    "--worker-overload-waiting-requests": _OVERLOAD,
    "--worker-overload-token-usage": _OVERLOAD,
    "--worker-overload-protection": _OVERLOAD,
    "--disable-worker-overload-protection": _OVERLOAD,
    "--worker-overload-shed": "prefixgate answers 429 or 503 (Retry-After) when no node can take a request",
    "--kv-index": "prefixgate's index is its own (embedded, or shared with --redis)",
    "--worker-stall-secs": "prefixgate bounds a first token with first_token_timeout_s and a stream with "
    "stall_timeout_s",
    "--worker-wedge-secs": "prefixgate bounds a first token with first_token_timeout_s",
    "--worker-stale-secs": "a node whose status poll fails is out of routing at once",
    "--worker-warmup-secs": _ROUTING,
    "--worker-warmup-share": _ROUTING,
    "--worker-warmup-blocks": _ROUTING,
    "--worker-warmup-thin-ratio": _ROUTING,
    "--worker-warmup-divert-every": _ROUTING,
    "--selection-policy": "use --policy (cache_aware is prefixgate's policy)",
    "--selection-accounting-ttl-ms": "prefixgate counts in-flight prefixes until the index shows them "
    "(inflight_prefixes)",
    "--overlap-decay": _ROUTING,
    "--selection-temperature": _ROUTING,
    "--bucket-adjust-interval-secs": "prefixgate has no bucket policy",
    "--eviction-interval-secs": "prefixgate's index follows the nodes' own evictions (KV events)",
    "--max-tree-size": "prefixgate's index follows the nodes' own evictions (KV events)",
    "--cache-boundaries": "prefixgate hashes every --block-size block",
    "--cache-index": "prefixgate's index is its own (embedded, or shared with --redis)",
    "--cache-ttl-secs": "prefixgate's index follows the nodes' own evictions (KV events)",
    "--max-idle-secs": "prefixgate has no sticky routing keys",
    "--sticky-key-idle-secs": "prefixgate has no sticky routing keys",
    "--assignment-mode": "prefixgate has no sticky routing keys",
    "--max-buffered-request-bytes": "prefixgate reads each request whole (--max-payload-size) before routing",
    "--pd-admission-wait-secs": _ADMISSION,
    "--stream-body-stall-timeout-secs": "prefixgate bounds a request body with --body-timeout",
    "--sse-keepalive-secs": "prefixgate sends no SSE keep-alive comments",
    "--dp-aware": "prefixgate treats each worker URL as one node",
    "--routing-key-override": _STICKY,
    "--sticky-sessions": _STICKY,
    "--routing-key-headers": "prefixgate has no routing keys",
    "--dp-minimum-tokens-scheduler": "prefixgate treats each worker URL as one node",
    "--enable-igw": "prefixgate serves the models its nodes name; no multi-model gateway mode",
    "--enable-rl": "prefixgate has no RL control plane",
    "--rl-control-timeout-secs": "prefixgate has no RL control plane",
    "--rl-fanout-concurrency": "prefixgate has no RL control plane",
    "--epd-disaggregation": "prefixgate has no encode stage (EPD)",
    "--encode": "prefixgate has no encode stage (EPD)",
    "--prefill-max-inflight-requests-per-worker": _OVERLOAD,
    "--prefill-queue-size": _ADMISSION,
    "--prefill-queue-timeout-secs": _ADMISSION,
    "--worker-startup-timeout-secs": _STARTUP,
    "--worker-startup-delay": _STARTUP,
    "--worker-startup-check-interval": "use --health-check-interval-secs (the status poll)",
    "--job-queue-capacity": "prefixgate has no control-plane job queue",
    "--job-queue-concurrency": "prefixgate has no control-plane job queue",
    "--load-monitor-interval": "use --health-check-interval-secs (the status poll carries the load)",
    "--disable-load-monitoring": _LIFECYCLE,
    "--multimodal-tensor-transport": _MM,
    "--multimodal-shm-min-bytes": _MM,
    "--multimodal-max-inflight-bytes": _MM,
    "--mm-per-request-image-limit": _MM,
    "--mm-processing": _MM,
    "--mm-pixel-cache-mb": _MM,
    "--mm-pixel-rdma": _MM,
    "--mm-allowed-media-domains": _MM,
    "--mm-allow-private-media-hosts": _MM,
    "--rdma-listen-ip": _MM,
    "--rdma-slot-ttl-s": _MM,
    "--log-mm-timing": _MM,
    "--log-dir": _LOGS,
    "--discovery-file": _DISCOVERY,
    "--discovery-check-interval-secs": _DISCOVERY,
    "--kv-connector-annotation": _DISCOVERY,
    "--kv-engine-id-annotation": _DISCOVERY,
    "--encode-selector": _DISCOVERY,
    "--router-selector": _DISCOVERY,
    "--model-id-from": _DISCOVERY,
    "--model-alias": "prefixgate serves the model names its nodes report, or --model",
    "--prometheus-duration-buckets": "prefixgate's histogram buckets are fixed",
    "--jemalloc-prof-dir": "prefixgate is a Python process; no jemalloc profiles",
    "--request-id-headers": "prefixgate reads X-Request-Id (and returns x-prefixgate-request-id)",
    "--storage-context-headers": _HISTORY,
    "--trust-tenant-header": _TENANCY,
    "--tenant-header-name": _TENANCY,
    "--cors-allowed-origins": "prefixgate makes no cross-origin allowance but --admin-origin for /admin",
    "--rate-limit-tokens-per-second": _ADMISSION,
    "--max-background-responses": _HISTORY,
    "--priority-scheduler-enabled": _ADMISSION,
    "--priority-scheduler-default-max-class": _ADMISSION,
    "--priority-scheduler-config": _ADMISSION,
    "--priority-scheduler-tenant-metric-top-n": _ADMISSION,
    "--tenant-rate-limit-enabled": "prefixgate's per-tenant limits are pin and document quotas",
    "--tenant-rate-limit-config": "prefixgate's per-tenant limits are pin and document quotas",
    "--cb-window-duration-secs": "prefixgate's breaker counts failed requests in a row, not in a window: "
    "see --cb-failure-threshold",
    "--health-check-endpoint": "prefixgate's probe is the worker protocol's status call, not an HTTP path",
    "--disable-health-check": "prefixgate's probe is its status poll, which routing needs",
    "--remove-unhealthy-workers": _KEEP,
    "--worker-auto-recovery": _KEEP,
    "--chat-template": _TOKENIZER,
    "--disable-tokenizer-autoload": _TOKENIZER,
    "--parser": _PARSER,
    "--tokenizer-cache-enable-l0": _TOKCACHE,
    "--tokenizer-cache-l0-max-entries": _TOKCACHE,
    "--tokenizer-cache-enable-l1": _TOKCACHE,
    "--tokenizer-cache-l0-max-memory": _TOKCACHE,
    "--tokenizer-cache-l1-max-memory": _TOKCACHE,
    "--reasoning-parser": _PARSER,
    "--mcp-config-path": "prefixgate runs no MCP tools",
    "--zmq-engine-count": "prefixgate drives workers over gRPC or HTTP (ZMQ only for KV events: --kv-events)",
    "--enable-wasm": "prefixgate runs no WebAssembly modules",
    "--storage-hook-wasm-path": "prefixgate runs no WebAssembly modules",
    "--history-backend": _HISTORY,
    "--history-memory-max-responses": _HISTORY,
    "--history-memory-max-items": _HISTORY,
    "--history-memory-retention-secs": _HISTORY,
    "--oracle-wallet-path": _HISTORY,
    "--oracle-tns-alias": _HISTORY,
    "--oracle-connect-descriptor": _HISTORY,
    "--oracle-username": _HISTORY,
    "--oracle-password": _HISTORY,
    "--oracle-external-auth": _HISTORY,
    "--oracle-pool-min": _HISTORY,
    "--oracle-pool-max": _HISTORY,
    "--oracle-pool-timeout-secs": _HISTORY,
    "--postgres-db-url": _HISTORY,
    "--postgres-pool-max": _HISTORY,
    "--postgres-op-timeout-secs": _HISTORY,
    "--redis-url": "smg's history store; prefixgate's shared index and state take --redis redis://HOST:PORT/DB",
    "--redis-pool-max": _HISTORY,
    "--redis-retention-days": _HISTORY,
    "--redis-op-timeout-secs": _HISTORY,
    "--schema-config": _HISTORY,
    "--client-cert-path": _TLS,
    "--client-key-path": _TLS,
    "--ca-cert-paths": _TLS,
    "--tls-cert-path": _TLS,
    "--tls-key-path": _TLS,
    "--enable-trace": "prefixgate exports no OpenTelemetry traces (x-prefixgate-request-id)",
    "--otlp-traces-endpoint": "prefixgate exports no OpenTelemetry traces",
    "--control-plane-api-keys": _AUTH,
    "--control-plane-audit-enabled": _AUTH,
    "--jwt-issuer": _AUTH,
    "--jwt-audience": _AUTH,
    "--jwt-jwks-uri": _AUTH,
    "--jwt-role-mapping": _AUTH,
    "--enable-mesh": _MESH,
    "--mesh-server-name": _MESH,
    "--mesh-host": _MESH,
    "--mesh-advertise-host": _MESH,
    "--mesh-port": _MESH,
    "--mesh-peer-urls": _MESH,
    "--mesh-tls-ca-cert": _MESH,
    "--mesh-tls-cert": _MESH,
    "--mesh-tls-key": _MESH,
}

# Flags taken and mapped (dest, argparse keywords, what it sets), in smg's spelling.
TAKEN: dict[str, tuple[str, dict[str, Any], str]] = {
    "--pd-disaggregation": (
        "smg_pd",
        {"action": "store_true"},
        "checks that --prefill and --decode are given",
    ),
    "--prefill-policy": ("smg_prefill_policy", {"metavar": "POLICY"}, "policy (the prefill node's choice)"),
    "--decode-policy": ("smg_decode_policy", {"metavar": "POLICY"}, "power_of_two or least_load only"),
    "--prometheus-port": ("prometheus_port", {"type": int}, "prometheus_port"),
    "--prometheus-host": ("prometheus_host", {}, "prometheus_host"),
    "--tenant-api-key": (
        "smg_tenant_keys",
        {"action": "append", "metavar": "TENANT_ID:KEY"},
        "api_keys KEY=TENANT",
    ),
    "--max-concurrent-requests": ("smg_max_concurrent", {"type": int}, "max_inflight"),
    "--request-timeout-secs": ("request_timeout_s", {"type": float}, "request_timeout_s"),
    "--queue-size": ("scheduler_queue_requests", {"type": int}, "scheduler_queue_requests"),
    "--queue-timeout-secs": ("scheduler_max_wait_s", {"type": float}, "scheduler_max_wait_s"),
    "--shutdown-grace-period-secs": ("shutdown_grace_s", {"type": float}, "shutdown_grace_s"),
    "--header-read-timeout-secs": ("smg_header_timeout", {"type": float}, "header_timeout_s"),
    "--idle-connection-timeout-secs": ("smg_idle_timeout", {"type": float}, "keepalive_timeout_s"),
    "--max-payload-size": ("max_body_bytes", {"type": int}, "max_body_bytes"),
    "--retry-max-retries": ("retry_max_attempts", {"type": int}, "retry_max_attempts"),
    "--retry-initial-backoff-ms": (
        "smg_retry_initial_ms",
        {"type": float},
        "retry_backoff_initial_s (/1000)",
    ),
    "--retry-max-backoff-ms": ("smg_retry_max_ms", {"type": float}, "retry_backoff_max_s (/1000)"),
    "--retry-backoff-multiplier": ("retry_backoff_multiplier", {"type": float}, "retry_backoff_multiplier"),
    "--retry-jitter-factor": ("smg_jitter_factor", {"type": float}, "retry_jitter_factor (retry_jitter_s 0)"),
    "--disable-retries": ("smg_disable_retries", {"action": "store_true"}, "retry_max_attempts 1"),
    "--cb-failure-threshold": ("breaker_failure_threshold", {"type": int}, "breaker_failure_threshold"),
    "--cb-success-threshold": ("breaker_success_threshold", {"type": int}, "breaker_success_threshold"),
    "--cb-timeout-duration-secs": (
        "smg_cb_timeout",
        {"type": float},
        "breaker_cooldown_s, breaker_max_cooldown_s",
    ),
    "--disable-circuit-breaker": ("smg_disable_cb", {"action": "store_true"}, "breaker_failure_threshold 0"),
    "--health-failure-threshold": ("health_failure_threshold", {"type": int}, "health_failure_threshold"),
    "--health-success-threshold": ("health_success_threshold", {"type": int}, "health_success_threshold"),
    "--health-check-timeout-secs": ("health_check_timeout_s", {"type": float}, "health_check_timeout_s"),
    "--health-check-interval-secs": ("stats_interval_s", {"type": float}, "stats_interval_s"),
    "--no-remove-unhealthy-workers": (
        "smg_keep_workers",
        {"action": "store_true"},
        "nothing: nodes are kept",
    ),
    "--no-worker-auto-recovery": ("smg_keep_workers", {"action": "store_true"}, "nothing: nodes are kept"),
    "--log-level": ("smg_log_level", {"choices": ["debug", "info", "warn", "warning", "error"]}, "log_level"),
    "--log-json": ("smg_log_json", {"action": "store_true"}, "log_format json"),
    "--model-path": ("tokenizer_path", {"metavar": "DIR"}, "tokenizer_path"),
    # Kubernetes discovery (gateway.cluster.k8s_discovery): the selectors become
    # discovery_kubernetes entries, the pods reached over HTTP as smg reaches them
    "--service-discovery": ("smg_discovery", {"action": "store_true"}, "discovery_kubernetes"),
    "--discovery-provider": (
        "smg_discovery_provider",
        {"choices": ["kubernetes", "file"]},
        "kubernetes only",
    ),
    "--selector": (
        "smg_selector",
        {"nargs": "+", "metavar": "KEY=VALUE"},
        "discovery_kubernetes regular=...",
    ),
    "--prefill-selector": ("smg_prefill_selector", {"nargs": "+", "metavar": "KEY=VALUE"}, "prefill=..."),
    "--decode-selector": ("smg_decode_selector", {"nargs": "+", "metavar": "KEY=VALUE"}, "decode=..."),
    "--service-discovery-port": ("discovery_kubernetes_port", {"type": int}, "discovery_kubernetes_port"),
    "--service-discovery-namespace": ("discovery_kubernetes_namespace", {}, "discovery_kubernetes_namespace"),
}

# The settings the taken flags set under the setting's own name (the others are converted below).
DIRECT_KEYS = tuple(dest for dest, _, _ in TAKEN.values() if not dest.startswith("smg_"))


def add_smg_arguments(p: argparse.ArgumentParser) -> None:
    """The smg flags ``prefixgate gateway`` takes, and every other one as a refusal."""
    group = p.add_argument_group(f"smg launch flags (smg {SMG_VERSION}; README: 'smg launch flags')")
    for flag, (dest, kwargs, sets) in TAKEN.items():
        if kwargs.get("action") != "store_true":
            kwargs = {"metavar": flag[2:].upper().replace("-", "_"), **kwargs}
        group.add_argument(flag, dest=dest, default=None, help=f"as smg's: {sets}", **kwargs)
    for flag in REFUSED:
        p.add_argument(flag, action=_Refuse, nargs="*", help=argparse.SUPPRESS)


def _policy(flag: str, name: str) -> str:
    """Our policy spec for ``name``: an smg name mapped, ours as given; refused smg ones raise."""
    if name in POLICY_REFUSED:
        raise SmgFlagRefused(
            f"{flag} {name}: smg's {name} policy is not in prefixgate ({POLICY_REFUSED[name]})"
        )
    return POLICY_MAP.get(name) or name


def _discovery(args: argparse.Namespace) -> dict[str, Any]:
    """smg's Kubernetes discovery flags as ``discovery_kubernetes`` entries (pods over HTTP)."""
    provider = args.smg_discovery_provider
    if provider == "file":
        raise SmgFlagRefused(
            "--discovery-provider file: prefixgate's discovery file is a list of smg worker bodies"
            " (discovery_file, docs/workers.md), not smg's file; set discovery_file instead"
        )
    selectors = {
        "regular": args.smg_selector,
        "prefill": args.smg_prefill_selector,
        "decode": args.smg_decode_selector,
    }
    on = args.smg_discovery or provider == "kubernetes"
    given = {role: labels for role, labels in selectors.items() if labels}
    if given and not on:
        raise SmgFlagRefused(
            f"--{next(iter(given))}-selector needs --service-discovery".replace("--regular-", "--")
        )
    if not on:
        return {}
    if not given:
        raise SmgFlagRefused(
            "--service-discovery needs --selector (or --prefill-selector and --decode-selector)"
        )
    entries = [f"{role}={','.join(labels)}" for role, labels in given.items()]
    return {"discovery_kubernetes": entries, "discovery_kubernetes_scheme": "http"}


def smg_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Setting overrides from the smg flags on ``args`` (and smg's policy names in ``--policy``).

    Raises ``SmgFlagRefused`` for a value prefixgate cannot give the same meaning.
    """
    out: dict[str, Any] = {k: getattr(args, k) for k in DIRECT_KEYS if getattr(args, k, None) is not None}
    policy = getattr(args, "policy", None)
    if policy is not None:
        out["policy"] = _policy("--policy", policy)
    if args.smg_prefill_policy is not None:  # smg: the prefill side's, over --policy
        out["policy"] = _policy("--prefill-policy", args.smg_prefill_policy)
    if args.smg_decode_policy is not None and args.smg_decode_policy not in DECODE_BY_LOAD:
        raise SmgFlagRefused(
            f"--decode-policy {args.smg_decode_policy}: prefixgate always picks the least busy decode node"
            f" (smg's {' or '.join(DECODE_BY_LOAD)}); leave it out"
        )
    if args.smg_tenant_keys:
        keys = list(args.api_keys or [])
        for entry in args.smg_tenant_keys:
            tenant, colon, key = entry.partition(":")
            if not (colon and tenant and key):
                raise SmgFlagRefused(f"--tenant-api-key {entry!r}: use TENANT_ID:KEY")
            keys.append(f"{key}={tenant}")
        out["api_keys"] = keys
    n = args.smg_max_concurrent
    if n is not None:
        if n == 0:
            raise SmgFlagRefused(
                "--max-concurrent-requests 0: prefixgate always bounds requests in flight; give a count"
            )
        if n > 0:
            out["max_inflight"] = n  # -1 (smg: derived from the host): prefixgate's default
        elif n != -1:
            raise SmgFlagRefused(f"--max-concurrent-requests {n}: give a count, or -1 for the default")
    for flag, dest, setting in (
        ("--header-read-timeout-secs", "smg_header_timeout", "header_timeout_s"),
        ("--idle-connection-timeout-secs", "smg_idle_timeout", "keepalive_timeout_s"),
    ):
        value = getattr(args, dest)
        if value is not None:
            if value <= 0:
                raise SmgFlagRefused(f"{flag} {value:g}: prefixgate always bounds it; give seconds above 0")
            out[setting] = value
    if args.smg_retry_initial_ms is not None:
        out["retry_backoff_initial_s"] = args.smg_retry_initial_ms / 1000.0
    if args.smg_retry_max_ms is not None:
        out["retry_backoff_max_s"] = args.smg_retry_max_ms / 1000.0
    if args.smg_jitter_factor is not None:  # smg's jitter alone: a share of the delay
        out["retry_jitter_factor"] = args.smg_jitter_factor
        out["retry_jitter_s"] = 0.0
    if args.smg_disable_retries:
        out["retry_max_attempts"] = 1  # smg: "equivalent to retry_max_retries=1"
    if args.smg_cb_timeout is not None:  # smg's open circuit waits this long every time
        out["breaker_cooldown_s"] = out["breaker_max_cooldown_s"] = args.smg_cb_timeout
    if args.smg_disable_cb:
        out["breaker_failure_threshold"] = 0
    if args.smg_log_level is not None:
        out["log_level"] = "warning" if args.smg_log_level == "warn" else args.smg_log_level
    if args.smg_log_json:
        out["log_format"] = "json"
    out.update(_discovery(args))
    return out


def check_pd(args: argparse.Namespace, prefill: Sequence[str], decode: Sequence[str]) -> str | None:
    """With ``--pd-disaggregation``, as in smg, prefill and decode workers are required (or
    the selectors that find them)."""
    found = bool(args.smg_prefill_selector and args.smg_decode_selector)
    if args.smg_pd and not (prefill and decode) and not found:
        return (
            "--pd-disaggregation needs at least one --prefill and one --decode worker"
            " (or --service-discovery with --prefill-selector and --decode-selector)"
        )
    return None
