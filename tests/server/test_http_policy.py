"""The HTTP access policy on a real gateway process (uvicorn on loopback): JSON-only bodies, the
admin API's Origin and Host checks, one proxy-header policy, the /metrics token."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from prefixgate.gateway.ops.processes import Child
from prefixgate.gateway.ops.stack import StackOptions, node_command
from tests.helpers import free_port, spawn

NODE = "127.0.0.1:1"  # never answers: these checks happen before any node is involved
CLIENT_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")
METRICS_TOKEN = "metrics-secret-for-tests"


def _gateway(env: dict[str, str]) -> tuple[str, Child]:
    port = free_port()
    proc = spawn(["gateway", "--port", str(port), "--decode", NODE], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.stop()
    raise RuntimeError("gateway did not start:\n" + "\n".join(proc.lines))


@pytest.fixture(scope="module")
def plain() -> Iterator[str]:
    """Default policy: no admin token (loopback trust), no trusted proxy."""
    url, proc = _gateway({})
    try:
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def proxied() -> Iterator[str]:
    """Behind a proxy on loopback, with a metrics token."""
    url, proc = _gateway(
        {"PREFIXGATE_TRUSTED_PROXIES": "127.0.0.1", "PREFIXGATE_METRICS_TOKEN": METRICS_TOKEN}
    )
    try:
        yield url
    finally:
        proc.stop()


def _draining(url: str) -> bool:
    nodes = httpx.get(url + "/admin/nodes", timeout=5).json()["data"]
    return bool(nodes[0]["draining"])


def test_text_plain_bodies_are_refused_not_parsed(plain: str) -> None:
    with httpx.Client(base_url=plain, timeout=10) as http:
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/documents", "/v1/prefill"):
            r = http.post(
                path, content=b'{"model": "prefixgate-sim"}', headers={"content-type": "text/plain"}
            )
            assert r.status_code == 415, (path, r.status_code, r.text)
            assert r.json()["error"]["code"] == "unsupported_media_type"
        r = http.post("/v1/documents", json={"text": "a document"})
        assert r.status_code == 201, r.text
        r = http.post(
            "/v1/documents",
            content=b'{"text": "x"}',
            headers={"content-type": "application/json; charset=utf-8"},
        )
        assert r.status_code == 201, r.text


def test_cross_site_requests_cannot_drive_the_admin_api(plain: str) -> None:
    drain = f"/admin/nodes/{NODE}/drain"
    with httpx.Client(base_url=plain, timeout=10) as http:
        attacks = [
            # a cross-site form / no-cors fetch: simple content type, foreign Origin
            {"content": b"{}", "headers": {"content-type": "text/plain", "origin": "http://attacker.test"}},
            {"content": b"drain=1", "headers": {"content-type": "application/x-www-form-urlencoded"}},
            {"content": b"", "headers": {"origin": "http://attacker.test"}},  # a body-less POST
            {"content": b"", "headers": {"content-type": "text/plain"}},
            {"json": {}, "headers": {"origin": "http://attacker.test"}},
            {"json": {}, "headers": {"origin": "null"}},
            # DNS rebinding: the page's own origin, but the attacker's name in Host
            {"json": {}, "headers": {"host": "evil.example.com", "origin": "http://evil.example.com"}},
            {"json": {}, "headers": {"host": "evil.example.com"}},
        ]
        for attack in attacks:
            r = http.post(drain, **attack)  # type: ignore[arg-type]
            assert r.status_code in (403, 415), (attack, r.status_code, r.text)
            assert not _draining(plain), attack
        r = http.get("/admin/nodes", headers={"host": "evil.example.com"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_host_not_allowed"
        # the gateway's own page and plain loopback clients still work, with or without a body
        own = plain.replace("http://", "")
        assert http.post(drain).status_code == 200
        assert http.post(drain, json={"drain": False}).status_code == 200
        assert http.post(drain, json={}, headers={"origin": plain}).status_code == 200
        assert _draining(plain)
        r = http.post(drain, json={"drain": False}, headers={"host": f"localhost:{own.split(':')[1]}"})
        assert r.status_code == 200 and not _draining(plain)


def test_proxy_headers_are_ignored_from_a_peer_that_is_not_a_trusted_proxy(plain: str) -> None:
    forged = {"forwarded": "for=203.0.113.9", "x-forwarded-for": "203.0.113.9", "x-real-ip": "203.0.113.9"}
    for name in CLIENT_HEADERS:
        r = httpx.get(plain + "/admin/nodes", headers={name: forged[name]}, timeout=5)
        assert r.status_code == 200, (name, r.status_code)


def test_proxy_headers_are_believed_alike_from_a_trusted_proxy(proxied: str) -> None:
    remote = {
        "forwarded": 'for="203.0.113.9:4711"',
        "x-forwarded-for": "203.0.113.9",
        "x-real-ip": "203.0.113.9",
    }
    local = {"forwarded": "for=127.0.0.1", "x-forwarded-for": "127.0.0.1", "x-real-ip": "127.0.0.1"}
    with httpx.Client(base_url=proxied, timeout=5) as http:
        for name in CLIENT_HEADERS:
            r = http.get("/admin/nodes", headers={name: remote[name]})
            assert r.status_code == 403, (name, r.status_code)
            assert r.json()["error"]["code"] == "admin_loopback_only"
            assert http.get("/admin/nodes", headers={name: local[name]}).status_code == 200, name
        # a proxy that names no client: unknown, never loopback
        assert http.get("/admin/nodes").status_code == 403
        # headers that disagree: the non-loopback one wins
        r = http.get("/admin/nodes", headers={"x-forwarded-for": "127.0.0.1", "x-real-ip": "203.0.113.9"})
        assert r.status_code == 403
        # a chain through trusted hops: the rightmost untrusted address is the client
        r = http.get("/admin/nodes", headers={"x-forwarded-for": "203.0.113.9, 127.0.0.1"})
        assert r.status_code == 403


def test_metrics_token(proxied: str, plain: str) -> None:
    with httpx.Client(base_url=proxied, timeout=5) as http:
        assert http.get("/metrics").status_code == 401
        r = http.get("/metrics", headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_metrics_token"
        r = http.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
        assert r.status_code == 200 and "prefixgate_" in r.text
    assert httpx.get(plain + "/metrics", timeout=5).status_code == 200  # no token set: open


def test_loopback_host_names() -> None:
    from prefixgate.gateway.httpfront.guard import is_loopback_host

    for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "127.1.2.3", "[::1]:8000", "app.localhost"):
        assert is_loopback_host(host), host
    for host in (
        "evil.example.com",
        "evil.example.com:8000",
        "10.0.0.1",
        "[2001:db8::1]:80",
        "",
        "localhost.evil",
    ):
        assert not is_loopback_host(host), host


def test_proxy_policy_chains() -> None:
    from prefixgate.gateway.httpfront.guard import ProxyPolicy

    p = ProxyPolicy(["10.0.0.0/8"])
    assert p.client("192.0.2.1", {b"x-real-ip": b"127.0.0.1"}) == "192.0.2.1"  # untrusted peer
    assert p.client("10.1.1.1", {b"x-forwarded-for": b"198.51.100.7, 10.2.2.2"}) == "198.51.100.7"
    assert (
        p.client("10.1.1.1", {b"forwarded": b'for=198.51.100.7;proto=https, for="[2001:db8::1]:80"'})
        == "2001:db8::1"
    )
    assert p.client("10.1.1.1", {}) == "unknown"


def test_stack_nodes_listen_on_loopback_whatever_the_gateway_binds() -> None:
    for gateway_host, node_host in (("0.0.0.0", "127.0.0.1"), ("::", "::1"), ("127.0.0.1", "127.0.0.1")):
        cmd = node_command("prefill", "prefill-1", 5000, StackOptions(host=gateway_host))
        assert cmd[cmd.index("--host") + 1] == node_host, (gateway_host, cmd)
