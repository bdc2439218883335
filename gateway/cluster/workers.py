"""Worker flags as smg spells them, and the node-client factory they configure.

``--prefill URL [BOOTSTRAP_PORT]`` (repeatable), ``--decode URL``, ``--worker-urls URL ...`` (a
monolithic pool) and ``--backend sglang|vllm`` carry over from an smg command line; the older
``--prefill HOST:PORT`` / ``--monolithic HOST:PORT`` (our own nodes) keep working. In a TOML file
or ``PREFIXGATE_*`` a prefill entry with a bootstrap port is one string, ``"URL PORT"``.

``normalize`` turns those into the settings the gateway runs on (prefill addresses without the
port, ``bootstrap_ports`` as ``URL=PORT``, worker URLs added to the monolithic pool) and
``connector`` builds each address's client, passing what a ``grpc://`` worker needs: the
runtime, the bootstrap port, the gateway's namespace (KV events are hashed into it) and the
engine's tokenizer; an ``http://`` prefill or decode worker gets the backend's PD over HTTP
(``nodeclient.http_pd``). Pools that cannot hand KV to each other (``http://`` prefill with
gRPC decode workers, or the reverse) are refused by ``normalize``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixgate.cachetier.hashing import Namespace

if TYPE_CHECKING:
    from prefixgate.gateway.config import Settings
    from prefixgate.gateway.nodeclient import NodeClient

BACKENDS = ("sglang", "vllm")
HTTP_SCHEMES = ("http", "https")
NO_PORT = ("none", "")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    url: str
    bootstrap_port: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """What a worker registered at runtime (``POST /workers``, smg's body) brings beyond its
    address: a prefill worker's bootstrap port, its runtime (SGLang or vLLM, for split serving
    and the SMG protocol), the key it wants, and what the operator said of it (model, priority,
    cost, labels: kept and reported; routing goes by cache and load). Shared with the other
    replicas in the membership record (``to_record``), the key included: a replica that adds
    the worker must reach it as this one does."""

    split: bool = False  # a prefill or decode worker (an http:// one hands KV its engine's way)
    bootstrap_port: int | None = None
    runtime: str = ""  # "sglang" | "vllm"; "": the gateway's --backend, else detected
    api_key: str = ""
    model_id: str = ""
    priority: int = 50
    cost: float = 1.0
    labels: tuple[tuple[str, str], ...] = ()

    def to_record(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "bootstrap_port": self.bootstrap_port,
            "runtime": self.runtime,
            "api_key": self.api_key,
            "model_id": self.model_id,
            "priority": self.priority,
            "cost": self.cost,
            "labels": dict(self.labels),
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> WorkerOptions:
        """A record ``to_record`` wrote; ValueError for one that is not (never applied)."""
        try:
            port = rec.get("bootstrap_port")
            labels = rec.get("labels") or {}
            return cls(
                bool(rec.get("split", False)),
                None if port is None else int(port),
                str(rec.get("runtime", "")),
                str(rec.get("api_key", "")),
                str(rec.get("model_id", "")),
                int(rec.get("priority", 50)),
                float(rec.get("cost", 1.0)),
                tuple(sorted((str(k), str(v)) for k, v in dict(labels).items())),
            )
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"worker options record {rec!r}: {e}") from None


NO_OPTIONS = WorkerOptions()


def parse_worker(entry: str) -> WorkerSpec:
    """``"URL"`` or ``"URL BOOTSTRAP_PORT"`` (``none`` for no port), as ``--prefill`` takes them."""
    parts = entry.split()
    if not parts or len(parts) > 2:
        raise ValueError(f"worker {entry!r}: expected URL [BOOTSTRAP_PORT]")
    url = parts[0]
    if len(parts) == 1 or parts[1].lower() in NO_PORT:
        return WorkerSpec(url)
    try:
        port = int(parts[1])
    except ValueError:
        raise ValueError(f"worker {entry!r}: bootstrap port {parts[1]!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"worker {entry!r}: bootstrap port {port} is out of range")
    return WorkerSpec(url, port)


def flag_entries(values: Sequence[Sequence[str]] | None) -> list[str] | None:
    """``--prefill`` given as ``append`` + ``nargs='+'``: each occurrence as one entry string."""
    if values is None:
        return None
    return [" ".join(v) for v in values]


def flat_urls(values: Sequence[Sequence[str]] | None) -> list[str] | None:
    """``--worker-urls A B --worker-urls C``: every URL."""
    if values is None:
        return None
    return [u for v in values for u in v]


def normalize(settings: Settings) -> Settings:
    """Settings with worker entries resolved: checked, ports split out, worker URLs pooled."""
    if settings.backend and settings.backend not in BACKENDS:
        raise ValueError(f"setting 'backend': use one of {', '.join(BACKENDS)}, got {settings.backend!r}")
    ports = bootstrap_ports(settings)
    prefill: list[str] = []
    for entry in settings.prefill:
        spec = parse_worker(entry)
        prefill.append(spec.url)
        if spec.bootstrap_port is not None:
            ports[spec.url] = spec.bootstrap_port
    decode = [_single(e, "decode") for e in settings.decode]
    monolithic = [_single(e, "monolithic") for e in settings.monolithic]
    monolithic += [_single(e, "worker-urls") for e in settings.worker_urls if e not in monolithic]
    check_split_pools(prefill, decode, settings.backend)
    return dataclasses.replace(
        settings,
        prefill=prefill,
        decode=decode,
        monolithic=monolithic,
        worker_urls=[],
        bootstrap_ports=[f"{u}={p}" for u, p in ports.items()],
    )


def id_workers(settings: Settings) -> list[str]:
    """The workers that take token ids of the model's own tokenizer (``grpc://``, the SMG engine
    protocol), in the order configured: the gateway must tokenize for them with that tokenizer."""
    out: list[str] = []
    for a in (*settings.prefill, *settings.decode, *settings.monolithic, *settings.worker_urls):
        url = parse_worker(a).url if a else a
        if url.startswith("grpc://") and url not in out:
            out.append(url)
    return out


def _http(url: str) -> bool:
    return url.partition("://")[0] in HTTP_SCHEMES


def check_split_pools(prefill: Sequence[str], decode: Sequence[str], backend: str) -> None:
    """Refuse prefill and decode pools that cannot hand KV to each other: an HTTP worker hands
    over only to an HTTP worker (its engine's PD over HTTP), a gRPC one only to a gRPC one; and
    HTTP split serving needs to know the engine family's way (``--backend``)."""
    pools = {"--prefill": prefill, "--decode": decode}
    flags = [f for f, urls in pools.items() if any(_http(u) for u in urls)]
    if not flags:
        return
    for flag, urls in pools.items():
        other = [u for u in urls if not _http(u)]
        if other:
            raise ValueError(
                f"{' and '.join(flags)} http:// workers cannot be paired with {flag} {other[0]}: "
                "in split serving every prefill and decode worker is http:// or none is"
            )
    if not backend:
        raise ValueError(
            f"{' and '.join(flags)} http:// workers need --backend sglang or vllm "
            "(how the engines hand KV over HTTP: SGLang's bootstrap room or vLLM's kv_transfer_params)"
        )


def _single(entry: str, flag: str) -> str:
    spec = parse_worker(entry)
    if spec.bootstrap_port is not None:
        raise ValueError(f"--{flag} {entry!r}: only a prefill worker takes a bootstrap port")
    return spec.url


def bootstrap_ports(settings: Settings) -> dict[str, int]:
    """Each prefill worker's bootstrap port from ``bootstrap_ports`` (``URL=PORT`` entries)."""
    return dict(_port_entry(p) for p in settings.bootstrap_ports)


def _port_entry(entry: str) -> tuple[str, int]:
    url, sep, port = entry.rpartition("=")
    if not sep or not port.isdigit():
        raise ValueError(f"setting 'bootstrap_ports': expected URL=PORT, got {entry!r}")
    return url, int(port)


def _codec(spec: str) -> Any:
    """The engine's tokenizer for detokenizing, when the gateway tokenizes with one (``hf:``)."""
    if not spec.startswith("hf:"):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(spec[3:])


def connector(
    settings: Settings,
    tokenizer_name: str | Callable[[str], str],
    codec: Any = None,
    *,
    codec_for: Callable[[str], Any] | None = None,
    registered: Mapping[str, WorkerOptions] | None = None,
    kv_batch_far: Callable[[bytes], Any] | None = None,
) -> Callable[[str], NodeClient]:
    """``NodePool``'s client factory for these settings.

    ``tokenizer_name`` (or a function of the model giving it: each model's workers may have a
    tokenizer of their own, and the gateway may load it after it starts) names the namespace
    events are re-hashed into; ``codec_for(model)``, else ``codec``, is the engine's
    ``tokenizers.Tokenizer`` for detokenizing (None: from the ``tokenizer`` spec, else the
    worker's ``tokenizer_path``); ``registered``: the options of workers added at runtime, read
    when each is connected; ``kv_batch_far``: where a long prompt's KV event batch is read
    (``SmgOptions``)."""
    from prefixgate.gateway import nodeclient
    from prefixgate.gateway.nodeclient.smg_common import SmgOptions

    ports = bootstrap_ports(settings)
    bs = settings.block_size
    unnamed = settings.default_model
    codec = codec if codec is not None else _codec(settings.tokenizer)
    name_of = tokenizer_name if callable(tokenizer_name) else lambda _model: tokenizer_name

    tenancy = settings.tenancy()

    def root_of(model: str, lora: str, salt: str) -> int | None:
        # Engine events name the salt the engine was given, if any: blocks stored under none are
        # the one tenant's, or nobody's when there are several (``gateway.core.tenancy``). The model
        # is the engine's own name, as requests for it are hashed (``NodePool.canonical``).
        model = model or unnamed
        return None if lora else Namespace(model, tenancy.event_salt(salt), bs, name_of(model)).root()

    split = set(settings.prefill) | set(settings.decode)

    def connect(address: str) -> NodeClient:
        scheme, _target = nodeclient.split_address(address)
        extra = (registered or {}).get(address, NO_OPTIONS)
        backend = extra.runtime or settings.backend
        port = extra.bootstrap_port if extra.bootstrap_port is not None else ports.get(address)
        if scheme in HTTP_SCHEMES and (address in split or extra.split):
            from prefixgate.gateway.nodeclient.http_pd import HttpPDOptions

            pd = HttpPDOptions(backend, port)
            return nodeclient.connect(
                address, http_pd=pd, engine_priority=settings.engine_priority, api_key=extra.api_key
            )
        if scheme in HTTP_SCHEMES:
            priority = settings.engine_priority
            return nodeclient.connect(address, engine_priority=priority, api_key=extra.api_key)
        if scheme != "grpc":
            return nodeclient.connect(address)
        options = SmgOptions(backend, port, bs, root_of, codec, codec_for, kv_batch_far)
        return nodeclient.connect(address, smg=options)

    return connect


# Protocols that carry no cache salt to the engine (``gateway.core.tenancy``).
UNSALTED_SCHEMES = ("grpc",)


def salted(address: str) -> bool:
    """Whether the worker's protocol carries the tenant's salt into its engine's cache key."""
    return address.partition("://")[0] not in UNSALTED_SCHEMES


def unsalted_workers(settings: Settings) -> list[str]:
    """The configured workers whose engines keep one prefix cache for every tenant."""
    addresses = [*settings.prefill, *settings.decode, *settings.monolithic, *settings.worker_urls]
    return [a for a in dict.fromkeys(addresses) if not salted(a)]


def tenancy_refusal(settings: Settings) -> str:
    """Why these settings cannot start ("" when they can): several tenants in front of engines
    that would share one cache between them, without the operator having agreed to that."""
    tenancy = settings.tenancy()
    unsalted = unsalted_workers(settings)
    if not unsalted or not tenancy.refused(isolates=False):
        return ""
    shown = ", ".join(unsalted[:3]) + (f" and {len(unsalted) - 3} more" if len(unsalted) > 3 else "")
    return (
        f"the API keys name {len(tenancy.salts)} tenant cache namespaces, but the SMG protocol of "
        f"{shown} carries no cache salt, so their engines would share one prefix cache between "
        "tenants (a tenant could tell from its latency what another sent); put them behind a "
        "protocol that carries one (http:// workers, prefixgate nodes), or accept one shared "
        'engine cache with --tenant-cache shared (tenant_cache = "shared")'
    )
