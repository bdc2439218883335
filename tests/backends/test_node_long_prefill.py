"""A node computing a long prefill still answers: health and loads at once, and a new request
after at most one chunk of the long one (chunked prefill, as SGLang's scheduler takes new requests
between the chunks of a long prompt), so a peer's health or silence bound does not give up on it.
The node runs as a process, as a peer sees it: nothing it does can hold the test's own loop; the
turn-taking itself is ``Admission.yield_turn``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from prefixgate.backends.admission import Admission
from prefixgate.v1 import node_pb2, node_pb2_grpc
from tests.helpers import spawn

LONG_TOKENS = 16_384
CHUNK = 2048


def generate(ids: list[int], rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=1),
    )


@pytest.fixture
async def address() -> AsyncIterator[str]:
    p = spawn(
        [
            "node",
            "--role",
            "monolithic",
            "--port",
            "0",
            "--log-level",
            "warning",
            # the simulated prefill of 16K tokens (about 0.35 s on the default profile) made 8x
            # longer, so the checks below run while it computes
            "--time-scale",
            "8",
            # 8 chunks of it: a new request waits for at most one (about 0.35 s here)
            "--chunked-prefill-size",
            str(CHUNK),
        ]
    )
    try:
        ready: dict[str, Any] = json.loads(
            p.wait_for(r'^(\{"event": "node_ready".*\})$', timeout=60).group(1)
        )
        yield str(ready["address"])
    finally:
        p.stop(timeout=10)


async def timed(coro: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = await coro
    return out, time.monotonic() - t0


async def test_health_loads_and_new_requests_are_answered_during_a_long_prefill(address: str) -> None:
    long_ids = [(i * 7 + 3) % 2000 + 3 for i in range(LONG_TOKENS)]
    async with grpc.aio.insecure_channel(address) as ch:
        smg = pb_grpc.SglangSchedulerStub(ch)
        native = node_pb2_grpc.NodeStub(ch)
        long_call = asyncio.ensure_future(
            timed(asyncio.wait_for(_complete(smg, generate(long_ids, "long")), 60))
        )
        for _ in range(100):  # until the node is computing it
            if (await native.Stats(node_pb2.StatsRequest(), timeout=5)).running_requests:
                break
            await asyncio.sleep(0.02)
        health, health_s = await timed(smg.HealthCheck(pb.HealthCheckRequest(), timeout=5))
        loads, loads_s = await timed(smg.GetLoads(pb.GetLoadsRequest(), timeout=5))
        stats, stats_s = await timed(native.Stats(node_pb2.StatsRequest(), timeout=5))
        short, short_s = await timed(_complete(smg, generate(long_ids[:40], "short")))
        assert not long_call.done()  # all of the above happened while the long prefill ran
        (long_done, long_s) = await long_call

    assert health.healthy and health_s < 0.5
    assert loads_s < 0.5 and loads.loads[0].num_running_reqs + loads.loads[0].num_waiting_reqs >= 1
    assert stats_s < 0.5 and stats.queued_tokens > 0  # the long prompt's rest is work ahead
    # the short request took a turn between two chunks instead of waiting for the whole prompt
    assert short.completion_tokens == 1 and short_s < 1.5 and short_s < long_s / 2
    assert long_done.prompt_tokens == LONG_TOKENS and long_done.completion_tokens == 1


async def _complete(stub: pb_grpc.SglangSchedulerStub, req: pb.GenerateRequest) -> Any:
    return [m async for m in stub.Generate(req, timeout=60)][-1].complete


async def test_a_turn_puts_the_running_ticket_behind_everyone_waiting() -> None:
    adm = Admission(max_running=1, max_queue=1)
    long = await adm.acquire(1000)
    short = asyncio.ensure_future(adm.acquire(10))
    await asyncio.sleep(0)
    assert len(adm.waiting) == 1
    turn = asyncio.ensure_future(adm.yield_turn(long))  # past max_queue: it was admitted
    await asyncio.sleep(0)
    ticket = await short
    assert adm.running == {ticket} and list(adm.waiting) == [long] and not turn.done()
    adm.release(ticket)
    await turn
    assert adm.running == {long} and not adm.waiting
    await adm.yield_turn(long)  # nobody waiting: it keeps running
    assert adm.running == {long}
