"""A request's ``priority`` in front of OpenAI-compatible HTTP workers: validated by the gateway
(400, param ``priority``), never relayed from the client's body, and sent to the engines only as
``engine_priority`` says: not at all (``off``, the default: a vLLM or SGLang not scheduling by
priority ignores or refuses it), as is (``on``) or negated (``inverted``, SGLang's higher-first),
on every request then, 0 included. Real engines' stand-ins on uvicorn, a real gateway."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from prefixgate.cachetier.hashing import Namespace
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.errors import InvalidRequest
from prefixgate.gateway.core.queueing import Gate
from prefixgate.gateway.core.request import Prepared, RequestContext
from prefixgate.gateway.grpcfront.servicer import request_body
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.nodeclient import OpenAIBody, connect
from prefixgate.gateway.nodeclient.http_openai import HttpOpenAIClient
from prefixgate.gateway.nodeclient.openai_body import with_priority
from prefixgate.openai.normalize import Layout
from prefixgate.openai.schema import MAX_PRIORITY, Sampling, parse_request
from prefixgate.v1 import gateway_pb2
from tests.httpworkers.appserver import serving
from tests.httpworkers.test_adapter import Engine, collect, prompt
from tests.httpworkers.test_http_pd_adapter import pair, run
from tests.httpworkers.test_http_pd_adapter import prompt as pd_prompt
from tests.smgwire.test_gateway_over_grpc import gateway

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def parse(**fields: Any) -> Any:
    body = {**CHAT, **fields}
    return parse_request(
        body, "chat", models={"m1"}, default_max_tokens=16, max_tokens_limit=64, max_documents=4
    )


def test_priority_is_an_integer_within_bounds() -> None:
    assert (parse().priority, parse().priority_given) == (0, False)
    assert (parse(priority=-3).priority, parse(priority=-3).priority_given) == (-3, True)
    assert parse(priority=0).priority_given and parse(priority=7.0).priority == 7
    assert parse(priority=MAX_PRIORITY).priority == MAX_PRIORITY
    for bad in ("high", 1.5, True, [1], MAX_PRIORITY + 1, -MAX_PRIORITY - 1):
        with pytest.raises(InvalidRequest) as e:
            parse(priority=bad)
        assert e.value.param == "priority", bad


def test_the_grpc_front_takes_priority_and_bodies_carry_it_as_set() -> None:
    body, _ = request_body(gateway_pb2.CompletionRequest(model="m1", prompt="x", priority=-2))
    assert body["priority"] == -2
    assert "priority" not in request_body(gateway_pb2.CompletionRequest(model="m1", prompt="x"))[0]
    req = OpenAIBody("chat", {"model": "m1"})
    assert with_priority(req, 5, "off") is req
    assert with_priority(req, 5, "on").body["priority"] == 5
    assert with_priority(req, 5, "inverted").body["priority"] == -5
    assert with_priority(req, 0, "on").body["priority"] == 0  # every request, the default too
    once = with_priority(req, 5, "on")
    assert with_priority(once, 5, "on") is once


# a class for the class-priority case (the default settings have only the class "default")
CLASSES = {"PREFIXGATE_PRIORITY_CLASSES": "batch:priority=5"}


@pytest.fixture
async def worker() -> AsyncIterator[tuple[Engine, str]]:
    eng = Engine()
    async with serving(eng.app()) as url:
        yield eng, url


async def test_an_http_worker_is_sent_priority_only_as_engine_priority_says(
    worker: tuple[Engine, str],
) -> None:
    eng, url = worker
    for mode, sent in (("off", None), ("on", 5), ("inverted", -5)):
        client = connect(url, engine_priority=mode)
        assert isinstance(client, HttpOpenAIClient)
        try:
            await collect(client, dataclasses.replace(prompt("m1"), priority=5))
        finally:
            await client.close()
        assert eng.requests[-1][2].get("priority") == sent, mode


async def test_split_http_workers_carry_it_on_both_legs() -> None:
    for backend in ("sglang", "vllm"):
        async with pair(backend) as (pe, de, p, d):
            p.engine_priority = d.engine_priority = "inverted"
            await run(p, d, dataclasses.replace(pd_prompt(), priority=3))
        assert [b["priority"] for _, b in pe.requests + de.requests] == [-3, -3], backend


async def test_the_gateway_relays_priority_only_under_engine_priority(worker: tuple[Engine, str]) -> None:
    eng, url = worker

    async def send(http: httpx.AsyncClient, **extra: object) -> dict[str, Any]:
        before = len(eng.requests)
        r = await http.post("/v1/chat/completions", json={**CHAT, **extra})
        assert r.status_code == 200, r.text
        assert len(eng.requests) == before + 1
        return eng.requests[-1][2]

    async with contextlib.AsyncExitStack() as stack:  # both gateways start at once
        off, inverted = await asyncio.gather(
            stack.enter_async_context(gateway("--worker-urls", url)),
            stack.enter_async_context(
                gateway("--worker-urls", url, "--engine-priority", "inverted", env=CLASSES)
            ),
        )
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=off))
        assert "priority" not in await send(http, priority=7)  # off: the client's is not relayed
        r = await http.post("/v1/chat/completions", json={**CHAT, "priority": 2.5})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "priority" and err["type"] == "invalid_request_error"
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=inverted))
        assert (await send(http, priority=7))["priority"] == -7
        assert (await send(http))["priority"] == 0
        # a class's priority reaches the engine where the client gives none
        http.headers["x-prefixgate-priority-class"] = "batch"
        assert (await send(http))["priority"] == -5
        assert (await send(http, priority=1))["priority"] == -1


def test_the_clients_priority_ranks_it_in_the_gateways_queue_over_its_class() -> None:
    settings = Settings(priority_classes=["batch:priority=5"])
    gate = Gate(settings, Metrics(), lambda _model: [], lambda: True)
    ns = Namespace("m1", "", 64)
    prep = Prepared(
        RequestContext("", "r1", priority_class="batch"), "r1", ns, Layout(""), b"", [], Sampling(4), "m1"
    )
    assert gate.schedule(prep).priority == 5  # none given: the class's
    given = dataclasses.replace(prep, priority=-2, priority_given=True)
    assert gate.schedule(given).priority == -2
    assert gate.schedule(dataclasses.replace(given, priority=0)).priority == 0  # 0 given is given
