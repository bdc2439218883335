"""Priority on our node: waiting prefills are taken up by (priority, arrival) under the
``priority`` policy (lower first, vLLM's meaning), in arrival order under ``fcfs``; a running
prefill keeps running, and between its chunks it steps back only for those of no lower priority.
Real nodes over gRPC on loopback, and a real gateway whose requests' ``priority`` reaches them."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from prefixgate.backends.admission import Admission
from prefixgate.backends.cli import add_node_arguments, node_options
from prefixgate.backends.server import NodeServer
from prefixgate.v1 import node_pb2
from tests.backends.test_node_grpc import until
from tests.smgwire.test_gateway_over_grpc import gateway

Prompt = Callable[..., tuple[bytes, list[int]]]
LONG = 8192  # tokens: about 2 s of simulated prefill at time scale 16, in 8 chunks
# the short requests must reach the node while the long prefill runs: at time scale 4 (0.5 s)
# a CI run on two loaded cores once saw it end first, and the queue was never seen holding one
TIME_SCALE = 16.0
CHUNK = 1024


def settled(cond: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    """``cond`` as ``until`` polls it."""
    return lambda: asyncio.sleep(0, cond())


async def test_waiting_tickets_go_by_priority_then_arrival() -> None:
    adm = Admission(max_running=1, max_queue=8, policy="priority")
    first = await adm.acquire()
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        t = await adm.acquire(priority=priority)
        order.append(name)
        adm.release(t)

    tasks = [asyncio.ensure_future(wait(n, p)) for n, p in [("a5", 5), ("b0", 0), ("c5", 5), ("d-1", -1)]]
    gone = asyncio.ensure_future(wait("gone", -9))
    await asyncio.sleep(0)
    gone.cancel()  # a cancelled waiter leaves the line
    await asyncio.sleep(0)
    assert [t.priority for t in adm.waiting] == [-1, 0, 5, 5]
    adm.release(first)
    await asyncio.gather(*tasks)
    assert order == ["d-1", "b0", "a5", "c5"] and not adm.waiting and not adm.running


async def test_fcfs_ignores_priority_and_a_turn_is_given_only_to_no_lower_priority() -> None:
    fcfs = Admission(max_running=1, max_queue=8, policy="fcfs")
    running = await fcfs.acquire(priority=0)
    later = asyncio.ensure_future(fcfs.acquire(priority=9))
    await asyncio.sleep(0)
    assert fcfs.yields_to(running)  # fcfs: a turn to anyone waiting
    fcfs.waiting.clear()
    later.cancel()

    adm = Admission(max_running=1, max_queue=8, policy="priority")
    running = await adm.acquire(priority=3)
    worse = asyncio.ensure_future(adm.acquire(priority=4))
    await asyncio.sleep(0)
    await adm.yield_turn(running)  # nobody of priority <= 3 waits: it keeps its slot
    assert adm.running == {running} and not worse.done()
    equal = asyncio.ensure_future(adm.acquire(priority=3))
    await asyncio.sleep(0)
    turn = asyncio.ensure_future(adm.yield_turn(running))  # behind the equal one, ahead of the worse
    await asyncio.sleep(0)
    assert [t.priority for t in adm.waiting] == [3, 4] and adm.waiting[0] is running
    adm.release(await equal)
    await turn
    assert adm.running == {running} and not worse.done()
    adm.release(running)
    adm.release(await worse)
    with pytest.raises(ValueError, match="scheduling policy"):
        Admission(1, 1, policy="lifo")


def test_the_node_flag_names_vllms_policies() -> None:
    parser = argparse.ArgumentParser()
    add_node_arguments(parser)
    assert node_options(parser.parse_args(["--role", "prefill"]))["scheduling_policy"] == "priority"
    args = parser.parse_args(["--role", "prefill", "--scheduling-policy", "fcfs"])
    assert node_options(args)["scheduling_policy"] == "fcfs"


async def _order(node: NodeServer, stub: Any, prompt: Prompt) -> list[str]:
    """A long prefill running, then a priority-5 request queued, then a priority-0 one: the order
    they finish in."""
    done: list[str] = []
    sp = node_pb2.SamplingParams(max_tokens=1, temperature=0.0)

    async def run(name: str, tokens: bytes, hashes: list[int], priority: int) -> None:
        req = node_pb2.GenerateRequest(
            request_id=name, tokens=tokens, block_hashes=hashes, sampling=sp, priority=priority
        )
        async for chunk in stub(node.address).Generate(req, timeout=30):
            if chunk.finish_reason:
                done.append(name)

    long = asyncio.ensure_future(run("long", *prompt(LONG, salt=1), 0))
    await until(settled(lambda: bool(node.node.prefills.running)))
    p5 = asyncio.ensure_future(run("p5", *prompt(64, salt=2), 5))
    await until(settled(lambda: len(node.node.prefills.waiting) == 1))
    p0 = asyncio.ensure_future(run("p0", *prompt(64, salt=3), 0))
    await asyncio.gather(long, p5, p0)
    return done


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
async def test_a_node_takes_waiting_prefills_up_by_its_policy(
    nodes: Callable[..., Awaitable[NodeServer]], stub: Any, prompt: Prompt, policy: str
) -> None:
    node = await nodes(time_scale=TIME_SCALE, chunked_prefill_size=CHUNK, scheduling_policy=policy)
    done = await _order(node, stub, prompt)
    assert sorted(done) == ["long", "p0", "p5"]
    if policy == "priority":  # the later priority-0 request went first
        assert done.index("p0") < done.index("p5")
    else:
        assert done.index("p5") < done.index("p0")


@pytest.mark.parametrize("split", [False, True], ids=["generate", "prefill"])
async def test_the_gateway_carries_a_requests_priority_to_our_node(
    nodes: Callable[..., Awaitable[NodeServer]], split: bool
) -> None:
    role = "prefill" if split else "monolithic"
    node = await nodes(role, time_scale=TIME_SCALE, chunked_prefill_size=CHUNK)  # default policy: priority
    flags = ["--prefill", node.address, "--decode", (await nodes("decode")).address] if split else []
    done: list[str] = []
    async with (
        # the gateway-held queue off: every request goes to the node at once, which orders them
        gateway(
            *(flags or ["--monolithic", node.address]), env={"PREFIXGATE_SCHEDULER_NODE_REQUESTS": "0"}
        ) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        r = await http.post(
            "/v1/completions", json={"model": "prefixgate-sim", "prompt": "x", "priority": "high"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"

        async def run(name: str, words: int, **extra: Any) -> None:
            prompt = " ".join(f"{name}{i}" for i in range(words))
            body = {"model": "prefixgate-sim", "prompt": prompt, "max_tokens": 1, **extra}
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-prefixgate-route"] == ("disaggregated" if split else "monolithic")
            done.append(name)

        long = asyncio.ensure_future(run("long", 4 * LONG // 7))  # bytes4: about LONG tokens
        await until(settled(lambda: bool(node.node.prefills.running)))
        p5 = asyncio.ensure_future(run("p5", 8, priority=5))
        await until(settled(lambda: len(node.node.prefills.waiting) == 1))
        p0 = asyncio.ensure_future(run("p0", 8))  # no priority: 0
        await asyncio.gather(long, p5, p0)
    assert done.index("p0") < done.index("p5")
