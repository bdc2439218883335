"""Tenants in front of ``grpc://`` engines, whose protocol carries no cache salt: the gateway
refuses several tenants on such workers unless told to share the engine's cache, and even then a
tenant learns nothing of another's prompts through any field or header."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson

from tests.helpers import spawn
from tests.smgwire.conftest import MODEL, StartNode
from tests.smgwire.test_gateway_over_grpc import gateway

KEYS = [f"--api-key=key-{t}={t}" for t in ("alice", "bob", "carol", "dave")]
# carol shares one namespace: before, engine events landed in it and showed her everyone's prompts;
# the admin token only lets the test read /admin/nodes. ``--tenant-cache shared`` (below) is the
# setting under test: at the default the gateway refuses these workers (the first test).
SHARED = {"PREFIXGATE_SHARED_NAMESPACES": "carol", "PREFIXGATE_ADMIN_TOKEN": "admin"}
SECRET = "Alice's merger memo: the board meets on the ninth about the acquisition. " * 40


def as_(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer key-{tenant}"}


def body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": SECRET, "max_tokens": 4, "temperature": 0, **kw}


async def cached(http: httpx.AsyncClient, tenant: str) -> tuple[int, str]:
    r = await http.post("/v1/completions", json=body(), headers=as_(tenant))
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.headers[
        "x-prefixgate-cached-tokens"
    ]


async def streamed_cached(http: httpx.AsyncClient, tenant: str) -> int:
    payload = body(stream=True, stream_options={"include_usage": True})
    async with http.stream("POST", "/v1/completions", json=payload, headers=as_(tenant)) as r:
        assert r.status_code == 200
        assert r.headers["x-prefixgate-cached-tokens"] == "0"
        last = [line async for line in r.aiter_lines() if line.startswith("data: {")][-1]
    return int(orjson.loads(last[6:])["usage"]["prompt_tokens_details"]["cached_tokens"])


async def usage_cached(http: httpx.AsyncClient, tenant: str) -> int:
    deadline = time.monotonic() + 5
    while True:  # counted locally, flushed every usage_flush_s
        r = await http.get("/v1/usage", headers=as_(tenant))
        assert r.status_code == 200, r.text
        totals = r.json()["totals"]
        if totals["requests"] >= 1 or time.monotonic() > deadline:
            return int(totals["cached_tokens"])
        await asyncio.sleep(0.1)


async def test_several_tenants_on_an_unsalted_engine_are_refused_at_start(nodes: StartNode) -> None:
    node = await nodes("monolithic")
    proc = spawn(["gateway", "--port", "0", "--worker-urls", f"grpc://{node.address}", *KEYS])
    rc = await asyncio.to_thread(proc.proc.wait, 30)
    out = "\n".join(proc.lines)
    assert rc == 2, out
    assert "carries no cache salt" in out and "--tenant-cache shared" in out
    assert "Traceback" not in out


async def test_a_tenant_learns_nothing_of_another_tenants_prompt(nodes: StartNode) -> None:
    node = await nodes("monolithic")
    worker = f"grpc://{node.address}"
    async with (
        gateway("--worker-urls", worker, *KEYS, "--tenant-cache", "shared", env=SHARED) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        await cached(http, "alice")
        again, _ = await cached(http, "alice")
        assert again > 0  # the engine really holds alice's prompt, and she is told of her reuse
        # each tenant's first sight of the prompt, through every way of asking
        assert await cached(http, "bob") == (0, "0")
        assert await streamed_cached(http, "carol") == 0
        r = await http.post("/v1/prefill", json=body(), headers=as_("dave"))
        assert r.status_code == 200, r.text
        assert [n["cached_tokens"] for n in r.json()["nodes"]] == [0], r.json()
        assert [await usage_cached(http, t) for t in ("bob", "carol")] == [0, 0]
        # a tenant's own reuse stays visible: bob has now sent the prompt himself
        for tenant in ("bob", "carol", "dave"):
            own, header = await cached(http, tenant)
            assert own > 0 and header == str(own), tenant
        # the engine cannot take a client's own salt either: refused, not ignored
        r = await http.post("/v1/completions", json=body(cache_salt="mine"), headers=as_("bob"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        rows = (await http.get("/admin/nodes", headers={"authorization": "Bearer admin"})).json()["data"]
        assert [n["tenant_cache"] for n in rows] == ["shared"]
