"""Which tenants may share an engine's prefix cache, and the salt each engine is given.

The gateway hashes every prompt in its tenant's namespace (``Namespace.tenant``, the *namespace
salt*), so its own index never matches one tenant's prompt against another's. An engine's prefix
cache is a second cache, keyed by the engine: tenants are isolated there only when the protocol
carries a salt into the engine's cache key:

- our node protocol: the salted block hashes *are* the cache key;
- OpenAI-compatible HTTP workers: ``cache_salt`` in the body (vLLM folds it into its block hashes;
  SGLang takes it, and ``extra_key`` on ``/generate``, into its radix key);
- the SMG protocol (``grpc://`` SGLang and vLLM) carries no salt: such an engine keeps one cache
  for every tenant it serves.

So with several tenants the gateway refuses workers of the third kind unless the operator opts
into a shared engine cache (``tenant_cache = "shared"``); and even then it reports a tenant only
the reuse its own, tenant-salted index credits that tenant with, never the engine's count of a
prefix another tenant left behind. Engine KV events name a salt only when the engine was given one:
blocks stored under no salt belong to the single tenant there is, or, with several, to nobody
(``HIDDEN_SALT``: a namespace no request is hashed in). Pure.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import xxhash

# The namespace of engine blocks that cannot be credited to any one tenant. No tenant name can
# produce it (tenant names are printable; see ``namespace_salt``).
HIDDEN_SALT = "\x00engine"
MAX_CLIENT_SALT = 256  # characters of a client's own ``cache_salt``
TENANT_CACHE_MODES = ("isolated", "shared")


def namespace_salt(tenant: str, shared: Collection[str], client_salt: str = "") -> str:
    """The salt a tenant's prompts are hashed under: its name, or "" for tenants that share one
    cache (``shared_namespaces``); a client's own ``cache_salt`` divides it further."""
    base = "" if tenant in shared else tenant
    return f"{base}\x1f{client_salt}" if client_salt else base


def engine_salt(salt: str) -> str:
    """What an engine is given for a namespace salt (empty: the engine's default namespace).

    A digest, not the tenant's name: engines log their requests, and a name typed by a client
    cannot be made to collide with another tenant's."""
    return f"pg-{xxhash.xxh3_128_hexdigest(salt.encode('utf-8'))}" if salt else ""


@dataclass(frozen=True)
class Tenancy:
    """The configured tenants' namespace salts (``{""}`` without API keys) and the operator's
    choice for engines that cannot isolate them."""

    salts: frozenset[str] = frozenset({""})
    shared_cache: bool = False  # ``tenant_cache = "shared"``
    _by_engine_salt: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, tenants: Iterable[str], shared: Collection[str], mode: str = "isolated") -> Tenancy:
        """``tenants``: those the API keys name (none: keyless, one tenant)."""
        if mode not in TENANT_CACHE_MODES:
            raise ValueError(f"tenant_cache must be one of {list(TENANT_CACHE_MODES)}, got {mode!r}")
        salts = frozenset(namespace_salt(t, shared) for t in tenants) or frozenset({""})
        return cls(salts, mode == "shared", {engine_salt(s): s for s in salts if s})

    @property
    def several(self) -> bool:
        """More than one cache namespace: an engine's shared cache would cross tenants."""
        return len(self.salts) > 1

    def shares_cache(self, isolates: bool) -> bool:
        """Whether a worker that isolates tenants (``isolates``) or not mixes them here."""
        return self.several and not isolates

    def refused(self, isolates: bool) -> bool:
        """A worker that would mix tenants without the operator having agreed to it."""
        return self.shares_cache(isolates) and not self.shared_cache

    def event_salt(self, engine_visible: str) -> str:
        """The namespace salt of blocks an engine reports under ``engine_visible`` (the salt it
        was given; "" when none)."""
        if engine_visible:
            return self._by_engine_salt.get(engine_visible, HIDDEN_SALT)
        if len(self.salts) == 1:
            return next(iter(self.salts))
        return HIDDEN_SALT

    def reported_cached(self, engine_cached: int, own_cached: int, isolates: bool) -> int:
        """The cached tokens a tenant is told of: the engine's count where the engine keeps the
        tenant's cache apart, else no more than the gateway's own index credits it with."""
        engine_cached = max(0, engine_cached)
        if self.shares_cache(isolates):
            return min(engine_cached, max(0, own_cached))
        return engine_cached
