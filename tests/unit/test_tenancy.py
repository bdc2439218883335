"""Which engine blocks a tenant may be credited with, and what it is told (pure)."""

from __future__ import annotations

import pytest

from prefixgate.gateway.config import load_settings
from prefixgate.gateway.core.tenancy import HIDDEN_SALT, Tenancy, engine_salt, namespace_salt


def test_blocks_stored_under_no_salt_are_the_one_tenants_or_nobodys() -> None:
    assert Tenancy.of([], []).event_salt("") == ""  # keyless: the one shared tenant
    assert Tenancy.of(["default"], []).event_salt("") == "default"  # one key: its tenant's
    several = Tenancy.of(["a", "b", "c"], ["c"])
    assert several.several and several.event_salt("") == HIDDEN_SALT  # not c's, though c shares ""
    assert several.event_salt(engine_salt("a")) == "a"
    assert several.event_salt(engine_salt("zz")) == HIDDEN_SALT
    assert not Tenancy.of(["a", "b"], ["a", "b"]).several  # both in the shared namespace


def test_a_tenant_is_told_only_its_own_reuse_on_a_shared_engine_cache() -> None:
    t = Tenancy.of(["a", "b"], [], "shared")
    assert t.reported_cached(7000, 0, isolates=False) == 0
    assert t.reported_cached(7000, 6400, isolates=False) == 6400
    assert t.reported_cached(7000, 6400, isolates=True) == 7000
    assert t.reported_cached(-5, 64, isolates=True) == 0
    assert Tenancy.of(["a"], []).reported_cached(7000, 0, isolates=False) == 7000
    assert t.refused(isolates=False) is False and Tenancy.of(["a", "b"], []).refused(isolates=False)


def test_salts() -> None:
    assert namespace_salt("a", []) == "a" and namespace_salt("a", ["a"]) == ""
    # a client's salt lives under its tenant's name: tenant names are printable (settings), so
    # no client salt can spell another tenant's namespace
    assert namespace_salt("a", [], "x") == "a\x1fx" and namespace_salt("", [], "x") == "\x1fx"
    assert engine_salt("") == "" and engine_salt("a") != engine_salt("b")
    with pytest.raises(ValueError):
        Tenancy.of(["a"], [], "open")
    with pytest.raises(ValueError, match="control character"):
        load_settings(overrides={"api_keys": ["k=a\x1fx"]}, environ={})
