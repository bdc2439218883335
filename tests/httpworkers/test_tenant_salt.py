"""Tenants in front of an OpenAI-compatible worker: each tenant's namespace reaches the engine as
``cache_salt`` (vLLM and SGLang key their prefix cache with it), a client's own ``cache_salt``
divides its tenant's namespace and can never name another's, and SGLang's ``extra_key`` is not
passed through behind the gateway's back."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from prefixgate.gateway.core.tenancy import engine_salt
from tests.httpworkers.appserver import serving
from tests.httpworkers.test_adapter import Engine
from tests.smgwire.test_gateway_over_grpc import gateway

KEYS = [f"--api-key=key-{t}={t}" for t in ("alice", "bob", "carol")]
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture
async def worker() -> AsyncIterator[tuple[Engine, str]]:
    eng = Engine()
    async with serving(eng.app()) as url:
        yield eng, url


async def test_each_tenant_reaches_the_engine_under_its_own_cache_salt(worker: tuple[Engine, str]) -> None:
    eng, url = worker
    env = {"PREFIXGATE_SHARED_NAMESPACES": "carol"}  # carol: the engine's default namespace
    async with (
        gateway("--worker-urls", url, *KEYS, env=env) as base,
        httpx.AsyncClient(base_url=base) as http,
    ):

        async def send(tenant: str, **extra: object) -> dict[str, object]:
            before = len(eng.requests)
            r = await http.post(
                "/v1/chat/completions",
                json={**CHAT, **extra},
                headers={"authorization": f"Bearer key-{tenant}"},
            )
            assert r.status_code == 200, r.text
            assert len(eng.requests) == before + 1
            return eng.requests[-1][2]

        alice = await send("alice")
        assert alice["cache_salt"] == engine_salt("alice")
        assert (await send("bob"))["cache_salt"] == engine_salt("bob") != alice["cache_salt"]
        assert "cache_salt" not in await send("carol")
        # a client's own salt divides its namespace; it cannot be made to name another tenant's
        assert (await send("alice", cache_salt="s1"))["cache_salt"] == engine_salt("alice\x1fs1")
        stolen = await send("bob", cache_salt=str(alice["cache_salt"]))
        assert stolen["cache_salt"] not in (alice["cache_salt"], engine_salt("bob"))
        r = await http.post(
            "/v1/chat/completions",
            json={**CHAT, "extra_key": "x"},
            headers={"authorization": "Bearer key-bob"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_key"
        assert all("extra_key" not in body for _, _, body in eng.requests)
