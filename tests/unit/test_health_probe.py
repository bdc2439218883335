"""The status poll is the health probe: it opens a node's breaker and lets it rejoin."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace

import grpc
import pytest

from prefixgate.gateway import nodeclient
from prefixgate.gateway.cluster.nodes import NodePool
from prefixgate.gateway.nodeclient import NodeFailure
from prefixgate.gateway.nodeclient.fake import (
    ALL_CAPABILITIES,
    FAKE_FORMAT,
    Fail,
    FakeNodeClient,
    fake_status,
)
from prefixgate.gateway.nodeclient.prefixgate_grpc import GrpcNodeClient, failed_stage, failure
from prefixgate.gateway.vocab import FailureKind, Stage
from tests.unit.seam_support import harness

pytestmark = pytest.mark.timeout(10)

TIMEOUT = Fail(FailureKind.TIMEOUT)


async def test_failed_probes_open_the_breaker_and_a_passing_probe_lets_one_trial_through() -> None:
    ok = fake_status("d1", "decode")
    d1 = FakeNodeClient("d1", status=[ok, TIMEOUT, TIMEOUT, ok])
    async with harness(("decode", d1)) as h:
        node = h.node("d1")
        assert node.routable and node.healthy
        assert not await h.pool.refresh(node)
        assert not node.routable and node.breaker.state == "closed"  # one miss: unreachable only
        assert not await h.pool.refresh(node)
        assert node.breaker.state == "open" and node.breaker.opens == 1 and not node.healthy
        assert await h.pool.refresh(node)
        assert node.breaker.state == "half_open" and node.routable
        ex = await h.pipeline.execute(h.prep())  # the trial succeeds: closed again
        assert node.breaker.state == "closed" and node.healthy
        await ex.close()


async def test_a_breaker_opened_by_failing_requests_waits_out_its_cooldown_despite_probes() -> None:
    async with harness(("decode", FakeNodeClient("d1"))) as h:
        node = h.node("d1")
        for _ in range(node.breaker.threshold):
            node.breaker.on_failure(time.monotonic())
        assert await h.pool.refresh(node)  # answers its status, yet failed real work
        assert node.breaker.state == "open" and not node.routable


async def test_the_periodic_probe_runs_by_itself() -> None:
    d1 = FakeNodeClient("d1", status=fake_status("d1", "decode"))
    pool = NodePool(0.02, connect=lambda a: d1, probe_timeout_s=0.05)
    try:
        node = pool.add("decode", "d1")
        assert await pool.wait_ready(timeout=2.0) and node.healthy
        d1.status_script = TIMEOUT
        for _ in range(100):
            if node.breaker.state == "open":
                break
            await asyncio.sleep(0.01)
        assert node.breaker.state == "open" and not node.reachable
        d1.status_script = fake_status("d1", "decode")
        for _ in range(100):
            if node.reachable:
                break
            await asyncio.sleep(0.01)
        assert node.reachable and node.breaker.state in ("half_open", "closed") and node.routable
    finally:
        await pool.close()


async def test_a_node_that_accepts_connections_but_answers_nothing_is_noticed() -> None:
    """A wedged node (e.g. SIGSTOPped): the kernel completes the TCP handshake, no RPC answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # never accepted, never answered
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        client = GrpcNodeClient(address)
        t0 = time.monotonic()
        with pytest.raises(NodeFailure) as info:
            await client.status(timeout=0.2)
        assert time.monotonic() - t0 < 1.0
        assert info.value.kind == FailureKind.TIMEOUT and info.value.stage == Stage.PROBE
        await client.close()
        pool = NodePool(connect=nodeclient.connect, probe_timeout_s=0.2, poll=False)
        try:
            node = pool.add("decode", address)
            assert not await pool.refresh(node) and not await pool.refresh(node)
            assert node.breaker.state == "open" and not node.routable
        finally:
            await pool.close()


def test_status_codes_and_the_stage_trailer_become_kind_and_blame() -> None:
    def rpc_error(code: grpc.StatusCode, details: str, stage: str | None = None) -> grpc.aio.AioRpcError:
        trailer = grpc.aio.Metadata(("x-prefixgate-stage", stage)) if stage else grpc.aio.Metadata()
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailer, details)

    refused = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "KV format differs", "transfer")
    assert failed_stage(refused) == "transfer"
    f = failure("d1", Stage.TRANSFER, refused)
    assert (f.node_id, f.stage, f.kind) == ("d1", Stage.TRANSFER, FailureKind.FORMAT_REFUSED)
    assert failed_stage(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", "queue")) == "queue"
    legacy = rpc_error(grpc.StatusCode.UNAVAILABLE, "KV transfer to decode node x failed (UNAVAILABLE)")
    assert failed_stage(legacy) == "transfer"
    kinds = {
        grpc.StatusCode.RESOURCE_EXHAUSTED: FailureKind.OVERLOADED,
        grpc.StatusCode.NOT_FOUND: FailureKind.HANDLE_GONE,
        grpc.StatusCode.DEADLINE_EXCEEDED: FailureKind.TIMEOUT,
        grpc.StatusCode.INVALID_ARGUMENT: FailureKind.INVALID,
        grpc.StatusCode.DATA_LOSS: FailureKind.INTERNAL,
    }
    for code, kind in kinds.items():
        assert failure("n", Stage.PREFILL, rpc_error(code, "x")).kind == kind
    assert failure("n", Stage.PREFILL, TimeoutError()).kind == FailureKind.TIMEOUT


def test_the_address_picks_the_protocol() -> None:
    assert nodeclient.split_address("127.0.0.1:5000") == ("prefixgate", "127.0.0.1:5000")
    assert nodeclient.split_address("grpc://[::1]:5000") == ("grpc", "[::1]:5000")
    assert nodeclient.split_address("http://127.0.0.1:5000") == ("http", "127.0.0.1:5000")
    with pytest.raises(ValueError, match="unknown node protocol"):
        nodeclient.split_address("ftp://127.0.0.1:5000")


async def test_a_node_given_block_hashes_of_another_size_is_refused_until_its_page_matches() -> None:
    fmt = FAKE_FORMAT  # 16-token pages
    own = replace(ALL_CAPABILITIES, block_hashes=True)  # as prefixgate's own protocol
    hashed = FakeNodeClient("d1", status=fake_status("d1", "decode", kv_format=fmt), capabilities=own)
    rehashed = FakeNodeClient("d2", status=fake_status("d2", "decode", kv_format=fmt))
    clients = {"d1": hashed, "d2": rehashed}
    pool = NodePool(connect=clients.__getitem__, poll=False, block_size=64)
    try:
        n1, n2 = pool.add("decode", "d1"), pool.add("decode", "d2")
        assert await pool.refresh(n1) and await pool.refresh(n2)  # both answer
        assert n1.reachable and not n1.routable and "its KV page is 16 tokens" in n1.refused
        assert n2.routable and not n2.refused  # its events are rehashed: any page serves
        hashed.status_script = fake_status("d1", "decode", kv_format=replace(fmt, block_size=64))
        assert await pool.refresh(n1)
        assert n1.routable and not n1.refused  # restarted with the gateway's block size
    finally:
        await pool.close()
