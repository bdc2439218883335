"""The gateway-held queue, live: a prefill node and a decode node (our sim nodes, their default
cost profile, time scale 1) behind a gateway with two API keys.

A flood of one tenant waits in the gateway, not on the node, so another tenant's requests and an
urgent class go before the flood's backlog; a sheddable class is refused at once when its
target cannot be met; the queue's bounds and a client leaving while waiting are answered and
leave nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import free_port, spawn

MODEL = "prefixgate-sim"
KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
# The classes the tests use; the default settings have only the class "default".
CLASSES = "urgent:priority=-5,batch:priority=5;ttft_slo_ms=100;sheddable"
PROMPT_WORDS = 3000  # ~4K tokens: ~45 ms of prefill at the default profile


@dataclass
class Stack:
    base: str
    bounded: str  # a second gateway with small queue bounds


def _node(role: str) -> tuple[Child, str]:
    proc = spawn(["node", "--role", role, "--port", "0", "--ready-line"])
    m = proc.wait_for(processes.NODE_READY, timeout=60)
    return proc, json.loads(m.group(0))["address"]


def _gateway(prefill: str, decode: str, env: dict[str, str]) -> tuple[Child, str]:
    port = free_port()
    keys = [f for tenant, key in KEYS.items() for f in ("--api-key", f"{key}={tenant}")]
    proc = spawn(["gateway", "--port", str(port), "--prefill", prefill, "--decode", decode, *keys], env=env)
    base = f"http://127.0.0.1:{port}"
    proc.wait_until(processes.answers_http(base + "/readyz"), 60)
    return proc, base


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Child] = []
    try:
        p, paddr = _node("prefill")
        procs.append(p)
        d, daddr = _node("decode")
        procs.append(d)
        g, base = _gateway(paddr, daddr, {"PREFIXGATE_PRIORITY_CLASSES": CLASSES})
        procs.append(g)
        # Small bounds, so that a handful of requests reach them: one prefill on the node at a
        # time, three waiting, 0.1 s each (two prefills of ~45 ms).
        bounded_env = {
            "PREFIXGATE_SCHEDULER_NODE_REQUESTS": "1",
            "PREFIXGATE_SCHEDULER_QUEUE_REQUESTS": "3",
            "PREFIXGATE_SCHEDULER_MAX_WAIT_S": "0.1",
        }
        g2, bounded = _gateway(paddr, daddr, bounded_env)
        procs.append(g2)
        yield Stack(base, bounded)
    finally:
        processes.stop_all(reversed(procs))


def _prompt(i: int, tenant: str) -> str:
    """A prompt no earlier request shares (a cached one would leave no backlog)."""
    return f"{uuid.uuid4().hex} {tenant} {i}: " + "the prefill queue orders requests " * (PROMPT_WORDS // 5)


async def _one(base: str, tenant: str, i: int, headers: dict[str, str] | None = None) -> tuple[float, int]:
    """Seconds to the answer and its status."""
    async with httpx.AsyncClient(timeout=60) as c:
        t0 = time.perf_counter()
        r = await c.post(
            base + "/v1/completions",
            headers={"authorization": f"Bearer {KEYS[tenant]}", **(headers or {})},
            json={"model": MODEL, "prompt": _prompt(i, tenant), "max_tokens": 1},
        )
        return time.perf_counter() - t0, r.status_code


async def _flood(
    base: str, n: int, then: list[tuple[str, dict[str, str]]]
) -> tuple[list[float], list[float]]:
    """``n`` requests of alice at once, then (once they wait) ``then`` one after another;
    the latencies of the flood and of ``then``."""
    flood = [asyncio.create_task(_one(base, "alice", i)) for i in range(n)]
    await asyncio.sleep(0.1)
    after: list[float] = []
    for j, (tenant, headers) in enumerate(then):
        s, status = await _one(base, tenant, 1000 + j, headers)
        assert status == 200
        after.append(s)
    done = await asyncio.gather(*flood)
    assert all(status == 200 for _, status in done)
    return sorted(s for s, _ in done), after


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_a_flooding_tenant_does_not_push_another_back(stack: Stack) -> None:
    flood, bob = asyncio.run(_flood(stack.base, 24, [("bob", {})] * 3))
    median = flood[len(flood) // 2]
    # bob arrived behind ~1 s of alice's backlog; served first come first served he would wait
    # for all of it, longer than the flood's median
    assert max(bob) < median / 2, (bob, median)
    assert _metric(stack.base, "prefixgate_scheduler_wait_seconds_count") > 0


def test_an_urgent_class_goes_before_the_backlog_of_its_own_tenant(stack: Stack) -> None:
    urgent = {"x-prefixgate-priority-class": "urgent"}
    flood, after = asyncio.run(_flood(stack.base, 24, [("alice", urgent)]))
    assert after[0] < flood[len(flood) // 2] / 2, (after, flood)


def test_a_sheddable_request_that_would_miss_its_target_is_refused_at_once(stack: Stack) -> None:
    batch = {"authorization": f"Bearer {KEYS['bob']}", "x-prefixgate-priority-class": "batch"}
    body = {"model": MODEL, "prompt": _prompt(0, "bob"), "max_tokens": 1}

    async def run() -> httpx.Response:
        flood = [asyncio.create_task(_one(stack.base, "alice", i)) for i in range(24)]
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(timeout=60) as c:
            t0 = time.perf_counter()
            r = await c.post(stack.base + "/v1/completions", headers=batch, json=body)
            took = time.perf_counter() - t0
        await asyncio.gather(*flood)
        assert took < 0.5, (took, r.status_code, r.text[:300])  # refused now, not after the backlog
        return r

    r = asyncio.run(run())
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "ttft_target_unreachable" and "100 ms" in err["message"]
    # with nothing ahead, the same request is served
    assert httpx.post(stack.base + "/v1/completions", headers=batch, json=body, timeout=60).status_code == 200


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-prefixgate-priority-class", "nosuch"),
        ("x-prefixgate-ttft-slo-ms", "soon"),
        ("x-prefixgate-ttft-slo-ms", "-5"),
    ],
)
def test_bad_scheduler_headers_are_400_naming_the_header(stack: Stack, header: str, value: str) -> None:
    client = openai.OpenAI(
        base_url=stack.base + "/v1", api_key=KEYS["bob"], max_retries=0, default_headers={header: value}
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=1)
    assert e.value.body is not None and e.value.body["param"] == header  # type: ignore[index]


def test_queue_bounds_refuse_with_retry_after_and_nothing_hangs(stack: Stack) -> None:
    long_prompt = uuid.uuid4().hex + " a long document to prefill " * 9000  # ~48K tokens: ~0.6 s

    async def post(c: httpx.AsyncClient, prompt: str) -> httpx.Response:
        return await c.post(
            stack.bounded + "/v1/completions",
            headers={"authorization": f"Bearer {KEYS['alice']}"},
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
        )

    async def run() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=60) as c:
            for _ in range(30):  # until this gateway has seen the other's load go (stats polls)
                if (await post(c, "warm up")).status_code == 200:
                    break
                await asyncio.sleep(0.2)
            hog = asyncio.create_task(post(c, long_prompt))  # holds the node's one prefill slot
            await asyncio.sleep(0.2)
            small = await asyncio.gather(*(post(c, _prompt(i, "alice")) for i in range(4)))
            return await hog, list(small)

    hog, small = asyncio.run(run())
    assert hog.status_code == 200, hog.text[:400]
    codes = sorted(r.json()["error"]["code"] for r in small)
    assert codes == ["queue_full", "queue_timeout", "queue_timeout", "queue_timeout"], codes
    assert all(r.status_code == 429 and int(r.headers["retry-after"]) >= 1 for r in small)
    assert "scheduler_queue_requests=3" in next(
        r.json()["error"]["message"] for r in small if r.json()["error"]["code"] == "queue_full"
    )
    assert _metric(stack.bounded, "prefixgate_scheduler_queue_requests") == 0
    assert _metric(stack.bounded, "prefixgate_inflight_requests") == 0


def test_a_client_that_leaves_while_waiting_leaves_nothing_behind(stack: Stack) -> None:
    async def run() -> None:
        flood = [asyncio.create_task(_one(stack.base, "alice", i)) for i in range(16)]
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(timeout=0.2) as c:
            leaving = [
                c.post(
                    stack.base + "/v1/completions",
                    headers={"authorization": f"Bearer {KEYS['bob']}"},
                    json={"model": MODEL, "prompt": _prompt(2000 + i, "bob"), "max_tokens": 1},
                )
                for i in range(8)
            ]
            gone = await asyncio.gather(*leaving, return_exceptions=True)
        assert any(isinstance(g, httpx.TimeoutException) for g in gone)
        await asyncio.gather(*flood)

    asyncio.run(run())
    for _ in range(50):  # the gateway notices the disconnects and the queue drains
        if _metric(stack.base, "prefixgate_inflight_requests") == 0:
            break
        time.sleep(0.1)
    assert _metric(stack.base, "prefixgate_inflight_requests") == 0
    assert _metric(stack.base, "prefixgate_scheduler_queue_requests") == 0


def test_explain_says_where_a_request_would_wait(stack: Stack) -> None:
    body = {"prompt": _prompt(0, "bob"), "max_tokens": 1}
    idle = httpx.post(stack.base + "/admin/cache/lookup", json=body, timeout=10).json()["scheduler"]
    assert idle["verdict"] == "start" and idle["priority_class"] == "default" and idle["waiting"] == 0

    async def busy() -> dict[str, Any]:
        flood = [asyncio.create_task(_one(stack.base, "alice", i)) for i in range(24)]
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(
                stack.base + "/admin/cache/lookup",
                json=body,
                headers={"x-prefixgate-priority-class": "batch"},
            )
        await asyncio.gather(*flood)
        return dict(r.json()["scheduler"])

    seen = asyncio.run(busy())
    assert seen["verdict"] == "shed" and seen["priority_class"] == "batch" and seen["ttft_slo_ms"] == 100
    assert seen["predicted_wait_ms"] > 100 and seen["waiting"] > 0
