"""Two gateway replicas (real processes) on one Redis hold a tenant to its tokens per minute:
clients hammering both get no more than the limit admitted, the rest 429 with Retry-After and
the limit named, on HTTP, through the ``openai`` client and on gRPC; the usage API shows the
window's use."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from prefixgate.bench.limits import HEADERS, KEY, MODEL, Deployment, chat_body, hammer
from prefixgate.gateway.state.redis_store import RedisState
from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc
from tests.cachetier.support import redis_url

LIMIT = 3_000  # tokens per minute; a request reserves ~66 prompt + 16 max_tokens


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    dep = Deployment(redis_url(), LIMIT, grpc=True).start()
    try:
        yield dep
    finally:
        dep.stop()
        state = RedisState(dep.redis, prefix=dep.prefix)

        async def purge() -> None:
            try:
                await state.purge()
            finally:
                await state.close()

        asyncio.run(purge())


def test_replicas_admit_the_limit_and_refuse_the_rest(deployment: Deployment) -> None:
    samples = asyncio.run(hammer(deployment.urls, 3.0, 6, max_tokens=16, pause=0.02))
    admitted = sum(s.tokens for s in samples if s.status == 200)
    refused = [s for s in samples if s.status == 429]
    assert {s.status for s in samples} <= {200, 429}
    assert LIMIT * 0.95 <= admitted <= LIMIT * 1.05, admitted
    assert admitted <= LIMIT  # within one window the counter never passes the limit
    assert refused and all(s.retry_after is not None and s.retry_after >= 1 for s in refused)
    assert all(
        s.message.startswith(f"tenant acme: {LIMIT} tokens per minute (tenant_tokens_per_minute)")
        for s in refused
    )
    for url in deployment.urls:  # both replicas see the shared window, settled (in the background)
        for _ in range(20):
            body = httpx.get(url + "/v1/usage", headers=HEADERS, timeout=10).json()
            (group,) = body["limits"]
            (row,) = group["data"]
            if row["used"] == admitted:
                break
            time.sleep(0.1)
        assert row == {
            "scope": "tenant",
            "unit": "tokens",
            "limit": LIMIT,
            "used": admitted,
            "setting": "tenant_tokens_per_minute",
        }


def test_refusals_on_the_openai_client_and_grpc(deployment: Deployment) -> None:
    asyncio.run(hammer(deployment.urls, 1.0, 4, max_tokens=16, pause=0.02))  # the window full
    client = openai.OpenAI(base_url=deployment.urls[1] + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(**chat_body(1, 16))
    assert e.value.code == "rate_limit_exceeded"
    assert int(e.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.BadRequestError) as bad:  # more than the limit itself: never fits
        client.chat.completions.create(**{**chat_body(2, 16), "max_tokens": LIMIT + 1})
    assert bad.value.code == "exceeds_rate_limit" and "retry-after" not in bad.value.response.headers
    with grpc.insecure_channel(f"127.0.0.1:{deployment.grpc_ports[0]}") as channel:
        with pytest.raises(grpc.RpcError) as g:
            gateway_pb2_grpc.GatewayStub(channel).Complete(
                gateway_pb2.CompletionRequest(model=MODEL, prompt="Hello there", max_tokens=200),
                metadata=[("authorization", f"Bearer {KEY}")],
                timeout=30,
            )
    err = g.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "tokens per minute (tenant_tokens_per_minute)" in err.details()  # type: ignore[attr-defined]
    trailer = dict(err.trailing_metadata())  # type: ignore[attr-defined]
    assert trailer["x-prefixgate-error-code"] == "rate_limit_exceeded" and int(trailer["retry-after"]) >= 1
