"""One auth implementation: API keys in constant time, the admin token, request ids."""

from __future__ import annotations

import hmac

import pytest

from prefixgate.gateway.core.auth import KeyRing, check_admin, valid_request_id
from prefixgate.openai.exceptions import Forbidden, Unauthenticated

KEYS = ["sk-a=alice", "sk-b=bob", "sk-c"]


def test_keys_name_their_tenant() -> None:
    ring = KeyRing(KEYS)
    assert ring.authenticate("Bearer sk-a") == "alice"
    assert ring.authenticate("bearer  sk-b ") == "bob"
    # A key without a tenant (smg's single --api-key) is the tenant "default", never the key
    # itself: tenants show in metrics labels, usage reports and the admin API.
    assert ring.authenticate("Bearer sk-c") == "default"
    assert KeyRing([]).authenticate("") is None  # keyless mode


@pytest.mark.parametrize("header", ["", "Bearer", "Basic sk-a", "Bearer sk-a-but-longer", "Bearer sk-"])
def test_missing_or_wrong_keys_are_refused_with_one_code(header: str) -> None:
    with pytest.raises(Unauthenticated) as e:
        KeyRing(KEYS).authenticate(header)
    assert e.value.code == "invalid_api_key"


def test_every_key_is_compared_whatever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[int] = []
    original = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(len(a))
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    ring = KeyRing(KEYS)
    for token in ("sk-a", "sk-c", "nope", "x" * 500):
        compared.clear()
        ring.tenant(token)
        assert len(compared) == len(KEYS)  # no early exit on a match
        assert set(compared) == {32}  # digests: the length of a guess is not compared


def test_admin_token_and_loopback() -> None:
    check_admin("tok", "Bearer tok", "203.0.113.9")
    for header in ("", "Bearer nope", "tok"):
        with pytest.raises(Unauthenticated) as e:
            check_admin("tok", header, "127.0.0.1")
        assert e.value.code == "invalid_admin_token"
    check_admin("", "", "127.0.0.1")
    check_admin("", "", "::1")
    with pytest.raises(Forbidden) as f:
        check_admin("", "", "203.0.113.9")
    assert f.value.code == "admin_loopback_only"


def test_request_ids() -> None:
    assert valid_request_id(None, "abc-1") == "abc-1"
    assert valid_request_id("first", "second") == "first"
    assert valid_request_id("x" * 129, "bad\nid", "é") is None
    assert valid_request_id("x" * 128) == "x" * 128
