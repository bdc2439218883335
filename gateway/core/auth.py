"""Who is calling: API keys, the admin token and the request id, for every front end.

One implementation so the HTTP and gRPC front ends answer a missing or wrong key with the same
error and code. Secrets are compared in constant time: a presented key is hashed and compared
with ``hmac.compare_digest`` against every configured key's hash, with no early exit and no
dictionary lookup, so neither the time nor the length of a comparison says how close a guess
was, or which tenant it came near.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from prefixgate.gateway.config import split_api_key
from prefixgate.gateway.core.errors import Forbidden, Unauthenticated

REQUEST_ID_MAX = 128
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def key_id(key: str) -> str:
    """An API key's id in rate-limit counters and the usage API: a digest, never the key."""
    return _digest(key).hex()[:16]


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (header or gRPC metadata)."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class KeyRing:
    """The configured API keys (``key=tenant`` entries, or a bare ``key``: ``BARE_KEY_TENANT``)
    and the tenant each one names."""

    def __init__(self, entries: Iterable[str]) -> None:
        keys: list[tuple[bytes, str]] = []
        for entry in entries:
            key, tenant = split_api_key(entry)
            keys.append((_digest(key), tenant))
        self._keys = tuple(keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def tenant(self, token: str) -> str | None:
        """The tenant of ``token``, or None; every key is compared, whatever matches first."""
        presented = _digest(token)
        found: str | None = None
        for digest, tenant in self._keys:
            if hmac.compare_digest(digest, presented) and found is None:
                found = tenant
        return found

    def tenants(self) -> dict[str, list[str]]:
        """Tenant -> the ids (``key_id``) of its keys."""
        out: dict[str, list[str]] = {}
        for digest, tenant in self._keys:
            out.setdefault(tenant, []).append(digest.hex()[:16])
        return out

    def authenticate(self, authorization: str) -> str | None:
        """The caller's tenant; None when no keys are configured (keyless mode).

        Raises ``Unauthenticated`` (code ``invalid_api_key``) for a missing or unknown key.
        """
        found = self.identify(authorization)
        return None if found is None else found[0]

    def identify(self, authorization: str) -> tuple[str, str] | None:
        """The caller's tenant and key id, as ``authenticate`` checks them; None when keyless."""
        if not self._keys:
            return None
        token = bearer_token(authorization)
        if token is None:
            raise Unauthenticated(
                "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        tenant = self.tenant(token)
        if tenant is None:
            raise Unauthenticated("incorrect API key provided", code="invalid_api_key")
        return tenant, key_id(token)


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def check_admin(admin_token: str, authorization: str, client_host: str) -> None:
    """Let the admin through: the admin token when one is set, else loopback clients only."""
    if admin_token:
        token = bearer_token(authorization)
        if token is None or not hmac.compare_digest(_digest(token), _digest(admin_token)):
            raise Unauthenticated(
                "admin token required: send 'Authorization: Bearer <admin token>'", code="invalid_admin_token"
            )
    elif not is_loopback(client_host):
        raise Forbidden(
            "the admin API without an admin token answers loopback clients only", code="admin_loopback_only"
        )


def valid_request_id(*candidates: str | None) -> str | None:
    """The first client-sent request id fit to log and echo (short, printable ASCII)."""
    for rid in candidates:
        if rid and len(rid) <= REQUEST_ID_MAX and rid.isascii() and rid.isprintable():
            return rid
    return None
