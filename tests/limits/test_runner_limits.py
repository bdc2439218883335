"""The runner reserves a request's tokens on its tenant's and key's counters when it enters and
settles them however it ends (success, failure, the client leaving), on a real service with
the embedded store; the admin is not limited; a failing store lets requests through."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.auth import key_id
from prefixgate.gateway.core.errors import Overloaded, RateLimited, Unavailable
from prefixgate.gateway.core.pipeline import Prepared
from prefixgate.gateway.core.request import Credentials
from prefixgate.gateway.core.runner import Caller
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.state.redis_store import RedisState
from prefixgate.openai.schema import parse_request

MODEL = "prefixgate-sim"
KEYED = Caller(authorization="Bearer sk-a")
MAX_TOKENS = 10


def service(**kw: object) -> GatewayService:
    settings = Settings(api_keys=["sk-a=alice", "sk-b=alice"], **kw)  # type: ignore[arg-type]
    return GatewayService(settings)


def prepare(svc: GatewayService, caller: Caller = KEYED, admin: bool = False) -> Prepared:
    parsed = parse_request(
        {"model": MODEL, "prompt": "hello there, general", "max_tokens": MAX_TOKENS},
        "completion",
        models=svc.models,
        default_max_tokens=4,
        max_tokens_limit=64,
        max_documents=1,
    )
    context = svc.runner.enter(caller, Credentials.ADMIN if admin else Credentials.CLIENT)
    return svc.pipeline.prepare(parsed, context)


@dataclass
class Generated:
    completion_tokens: int = 0


@dataclass
class Gen:
    """A job that generates on no node: ``n`` choices, ``fail`` before its start."""

    n: int = 1
    fail: bool = False
    refused: bool = False  # refused before any node computed it (the gateway's queue)

    async def start(self, prepared: Prepared) -> Generated:
        if self.fail:
            raise Unavailable("no node")
        if self.refused:
            raise Overloaded("not scheduled: the queue is full", code="queue_full", retry_after=1)
        return Generated()

    async def close(self, started: Generated) -> None:
        return None

    def max_output_tokens(self, prepared: Prepared) -> int:
        return self.n * prepared.sampling.max_tokens


async def used(svc: GatewayService, tenant: str = "alice") -> dict[str, int]:
    await svc.limits.drain()
    return {
        f"{u.scope}:{u.unit}{':' + u.key if u.key else ''}": u.used
        for u in await svc.limits.use(tenant, [key_id("sk-a")])
    }


async def test_reserved_then_settled_to_what_was_used() -> None:
    svc = service(tenant_tokens_per_minute=1000, key_requests_per_minute=100)
    prep = prepare(svc)
    p = prep.prompt_tokens
    async with svc.runner.run(prep, Gen(n=2)) as g:
        assert (await used(svc))["tenant:tokens"] == p + 2 * MAX_TOKENS  # n choices of max_tokens
        g.completion_tokens = 7
    assert await used(svc) == {"tenant:tokens": p + 7, f"key:requests:{key_id('sk-a')}": 1}
    with pytest.raises(Unavailable):  # failed before generating: its output part given back
        async with svc.runner.run(prep, Gen(fail=True)):
            pass
    assert (await used(svc))["tenant:tokens"] == 2 * p + 7
    with pytest.raises(Overloaded):  # refused before any node computed it: all given back
        async with svc.runner.run(prep, Gen(refused=True)):
            pass
    assert (await used(svc))["tenant:tokens"] == 2 * p + 7

    async def leaves() -> None:  # the client leaves mid-stream, 3 tokens sent
        async with svc.runner.run(prep, Gen()) as g:
            g.completion_tokens = 3
            await asyncio.sleep(60)

    task = asyncio.create_task(leaves())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await used(svc))["tenant:tokens"] == 3 * p + 10
    assert svc.pipeline.inflight == 0


async def test_key_and_tenant_limits_refuse_naming_the_setting() -> None:
    svc = service(key_requests_per_minute=2, tenant_limits=["alice:rpm=3"])
    prep = prepare(svc)
    for _ in range(2):
        async with svc.runner.run(prep, Gen()):
            pass
    with pytest.raises(RateLimited) as e:
        async with svc.runner.run(prep, Gen()):
            pass
    assert e.value.message.startswith(f"API key {key_id('sk-a')} of tenant alice: 2 requests per minute")
    assert "(key_requests_per_minute)" in e.value.message and e.value.retry_after is not None
    other = prepare(svc, Caller(authorization="Bearer sk-b"))  # the tenant's other key
    async with svc.runner.run(other, Gen()):
        pass
    with pytest.raises(RateLimited) as t:
        async with svc.runner.run(other, Gen()):
            pass
    assert t.value.message.startswith("tenant alice: 3 requests per minute (tenant_limits)")
    assert svc.pipeline.inflight == 0
    admin = prepare(svc, Caller(client_host="127.0.0.1"), admin=True)  # the admin is not limited
    async with svc.runner.run(admin, Gen()):
        pass


async def test_a_failing_store_lets_requests_through_and_counts_them() -> None:
    svc = service(tenant_requests_per_minute=1)
    svc.limits.state = RedisState("redis://127.0.0.1:1/0", timeout=0.2)  # nothing listens there
    prep = prepare(svc)
    for _ in range(3):
        async with svc.runner.run(prep, Gen()):
            pass
    assert svc.metrics.registry.get_sample_value("prefixgate_rate_limit_store_failures_total") == 3
    await svc.limits.state.close()


def test_unknown_tenant_in_tenant_limits_is_a_startup_error() -> None:
    from prefixgate.gateway.config import load_settings

    with pytest.raises(ValueError, match="tenant 'acmee' is named by no API key"):
        load_settings(overrides={"api_keys": ["k=acme"], "tenant_limits": ["acmee:tpm=5"]}, environ={})
    env = {"PREFIXGATE_TENANT_LIMITS": "default:tpm=5,rpm=2"}  # keyless: the tenant "default"
    assert load_settings(environ=env).tenant_limits == ["default:tpm=5", "rpm=2"]
    with pytest.raises(ValueError, match="below 0"):
        load_settings(overrides={"tenant_tokens_per_minute": -1}, environ={})
