"""Fault drills: client disconnects, two gateways on one index, Redis restarted empty (see ``drills.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time

import httpx
import pytest

from prefixgate.bench.redis_cluster import start_redis
from prefixgate.cachetier.redis_index import RedisIndex, connect
from prefixgate.gateway.ops.processes import Child
from tests.faults.cluster import Cluster, NodeProc, Tally, drive, one
from tests.faults.drills import (
    REPORT,
    all_routable,
    body,
    tally,
    until,
)
from tests.helpers import free_port, spawn


def _aborts(node: NodeProc, known: bool = True) -> list[str]:
    """The node's log lines for an ``Abort`` it received (``known``: of a request still running)."""
    assert node.proc is not None
    lines = [line for line in list(node.proc.lines) if '"event": "abort"' in line]
    return [line for line in lines if '"known": true' in line] if known else lines


def test_client_disconnect_during_prefill_cancels_node_work(cluster: Cluster) -> None:
    """Clients that hang up while their prefill runs: the nodes drop the work (no orphaned
    prefills queued or running) and the gateway's in-flight count returns to 0. Over ``grpc://``
    the gateway sends ``Abort`` to the engine for both legs (the prefill node drops the prefill,
    the decode node its waiting request)."""
    all_routable(cluster)
    smg = cluster.protocol == "smg"
    hang_ups, hang_after_s = 4, 0.5
    for n in cluster.prefill:  # 10x slower: a 3000-token prefill takes seconds, the clients leave first
        n.signal(signal.SIGUSR1)
    aborts0 = {n.node_id: len(_aborts(n, known=n.role == "prefill")) for n in cluster.nodes}

    async def hang_up(i: int) -> None:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(one(http, body(9500 + i, tokens=3000), stream=True), hang_after_s)

    def load() -> tuple[int, int]:
        nodes = httpx.get(cluster.url + "/admin/nodes", timeout=5).json()["data"]
        busy = sum(n["load"]["queued_requests"] + n["load"]["running_requests"] for n in nodes)
        return busy, sum(
            n["load"]["local_requests"] + n["load"]["active_streams"] + n["load"]["pending_streams"]
            for n in nodes
        )

    def prefill_aborts() -> int:
        return sum(len(_aborts(n)) - aborts0[n.node_id] for n in cluster.prefill)

    async def disconnect() -> int:
        # The nodes' figures reach /admin/nodes through the gateway's stats poll, so a single
        # reading can miss the queue on a loaded machine: sample until the clients leave.
        tasks = [asyncio.create_task(hang_up(i)) for i in range(hang_ups)]
        busiest = 0
        while not all(t.done() for t in tasks):
            busiest = max(busiest, *(await asyncio.to_thread(load)))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        return busiest

    try:
        busy_before = asyncio.run(disconnect())
        left_at = time.monotonic()
        idle = until(
            lambda: (
                load() == (0, 0)
                and cluster.metric("prefixgate_inflight_requests") == 0
                and (not smg or prefill_aborts() >= hang_ups)
            ),
            8.0,
        )
        idle_after_s = time.monotonic() - left_at
    finally:
        for n in cluster.prefill:
            n.signal(signal.SIGUSR2)
    decode_aborts = sum(len(_aborts(n, known=False)) - aborts0[n.node_id] for n in cluster.decode)
    before = cluster.metric("prefixgate_retries_total")
    follow = asyncio.run(drive(cluster.url, [body(9600 + i, tokens=3000, max_tokens=4) for i in range(2)], 2))
    slowest = max(r.ended_at - r.started_at for r in follow)
    aborted = f"; Abort reached {prefill_aborts()} prefill legs ({decode_aborts} decode legs)" if smg else ""
    t = tally(
        "clients hang up during prefill",
        follow,
        cluster,
        before,
        note=f"{hang_ups} clients left after {hang_after_s:g} s{aborted}; queues and in-flight 0 after "
        f"{idle_after_s:.1f} s; 2 follow-ups in {slowest:.1f} s",
    )
    t.sent += hang_ups
    assert busy_before >= 2, busy_before  # the work was on the nodes when the clients left
    assert idle, (load(), cluster.metric("prefixgate_inflight_requests"), prefill_aborts())
    if smg:
        assert prefill_aborts() >= hang_ups  # the engine was told while it still worked
        assert decode_aborts >= hang_ups, decode_aborts
    assert t.failed == 0 and t.succeeded == 2
    assert slowest < 5.0, "no orphaned prefills ahead of the follow-ups"


# the index fed by the engines' KV events (ours: tests/shared_index): the drill runs on smg only.
@pytest.mark.parametrize("cluster", ["smg"], indirect=True)
def test_two_gateways_share_the_index_and_route_as_one(
    cluster: Cluster, redis_port: tuple[int, list[Child]]
) -> None:
    """A second gateway on the same Redis and the same ``grpc://`` workers: a prefix the first
    one routed (its blocks known from the engines' KV events) is sent by the second to the same
    prefill node, and hits there."""
    all_routable(cluster)
    b_port = free_port()
    args = ["gateway", "--port", str(b_port), *cluster.gateway_args[:2]]
    for n in cluster.prefill:
        args += ["--prefill", *n.worker_entry]
    for n in cluster.decode:
        args += ["--decode", n.address]
    url, prefix = cluster.gateway_args[1], cluster.gateway_env["PREFIXGATE_REDIS_PREFIX"]
    env = {"PREFIXGATE_REDIS_PREFIX": prefix}
    second = spawn(args, env=env)
    b_url = f"http://127.0.0.1:{b_port}"
    try:
        assert until(lambda: _ready(b_url, len(cluster.prefill)), 20.0), second.tail(20)
        for seed in range(3):  # several prefixes, so "same node" is not luck
            settled = functools.partial(_index_settled, url, prefix, _index_blocks(url, prefix))
            first = httpx.post(
                cluster.url + "/v1/chat/completions", json=body(7500 + seed, 1500, max_tokens=2), timeout=30
            )
            assert first.status_code == 200, first.text
            # the engine's events reach the index off the hot path: until they have all landed
            assert until(settled, 10.0), "no KV events indexed"
            again = httpx.post(
                b_url + "/v1/chat/completions", json=body(7500 + seed, 1500, max_tokens=4), timeout=30
            )
            assert again.status_code == 200, again.text
            assert again.headers["x-prefixgate-prefill-node"] == first.headers["x-prefixgate-prefill-node"]
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        rc = second.stop()
        assert rc == 0, (rc, second.tail(20))


def _ready(url: str, prefill: int) -> bool:
    try:
        return bool(httpx.get(url + "/readyz", timeout=1).json().get("prefill") == prefill)
    except (httpx.HTTPError, ValueError):
        return False


def _index_blocks(url: str, prefix: str) -> int:
    async def read() -> int:
        idx = RedisIndex(connect(url), prefix=prefix)
        try:
            return (await idx.stats()).total_blocks
        finally:
            await idx.close()

    return asyncio.run(read())


def _index_settled(url: str, prefix: str, before: int) -> bool:
    """The index holds more blocks than ``before`` and no more arrive for a moment."""
    now = _index_blocks(url, prefix)
    if now <= before:
        return False
    time.sleep(0.2)
    return _index_blocks(url, prefix) == now


# the index rebuilt from SubscribeKvEvents: the drill runs on smg only.
@pytest.mark.parametrize("cluster", ["smg"], indirect=True)
def test_redis_restarted_empty_index_rebuilt_from_kv_events(
    cluster: Cluster, redis_port: tuple[int, list[Child]]
) -> None:
    """Redis comes back empty: the gateway notices, resubscribes each engine's
    ``SubscribeKvEvents`` (the subscription opens with the blocks the engine holds) and the index
    holds again what it held; requests meanwhile all succeed. Last in the module: it empties the
    Redis the other protocol's cluster shares (run after it, by the fixture's order)."""
    port, procs = redis_port
    url = cluster.gateway_args[1]
    prefix = cluster.gateway_env["PREFIXGATE_REDIS_PREFIX"]
    all_routable(cluster)
    # 8 prompts at 6 at once: both prefill nodes hold some, so a repeat sent where the index
    # says hits only if the index was rebuilt for each node; 2 tokens each, decoding plays no part
    results = asyncio.run(drive(cluster.url, [body(7000 + i, 1500, max_tokens=2) for i in range(8)], 6))
    assert until(lambda: _index_blocks(url, prefix) > 0, 5.0)
    time.sleep(0.5)  # the last events land
    held = _index_blocks(url, prefix)
    procs[-1].stop(signal.SIGKILL)
    procs.append(start_redis(port))  # idle: no request in flight
    t0 = time.monotonic()
    assert until(lambda: _index_blocks(url, prefix) >= held, 15.0), (held, _index_blocks(url, prefix))
    took = time.monotonic() - t0
    view = httpx.get(cluster.url + "/admin/cache", timeout=5).json()
    assert view["index"]["total_blocks"] >= held and not view["index"]["degraded"], view["index"]
    # one at a time: each goes where its prefix is, never elsewhere for want of a free node
    repeat = asyncio.run(drive(cluster.url, [body(7000 + i, 1500, max_tokens=2) for i in range(8)], 1))
    results += repeat
    resynced = cluster.metric("prefixgate_index_resyncs_total", reason="index_data_lost")
    hits = sum(1 for r in repeat if r.cached_tokens > 0)
    t = Tally("Redis restarted empty (data loss) (grpc://)", len(results))
    t.succeeded = sum(1 for r in results if r.status == 200 and r.finish)
    t.failed = sum(1 for r in results if r.status != 200)
    t.note = (
        f"index rebuilt from SubscribeKvEvents in {took:.1f}s ({int(resynced)} nodes resynced); "
        f"{hits}/8 repeats hit the cache"
    )
    REPORT.append(t)
    assert t.failed == 0 and t.succeeded == 16
    assert resynced >= 4, resynced
    assert hits == 8, [r.cached_tokens for r in repeat]
