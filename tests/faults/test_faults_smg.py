"""The fault drills on the SMG engine protocol: the gateway in front of ``grpc://`` workers.

The same guarantees as on the gateway's own protocol (``test_faults``), with our nodes serving
``sglang.grpc.scheduler.SglangScheduler``: SGLang PD (both legs at once, KV handed over through
the prefill node's bootstrap port), token ids in and out (the gateway tokenizes with the
tokenizer the nodes ship), the index fed by ``SubscribeKvEvents``. One cluster for the module
(2 prefill + 2 decode nodes, its own Redis), modest request counts: the module adds well under
a minute and a half to a CI run.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from prefixgate.cachetier.redis_index import RedisIndex, connect
from tests.faults.cluster import Cluster, NodeProc, Tally, drive, one, start_redis
from tests.faults.conftest import REPORT
from tests.faults.test_faults import body as seeded_body
from tests.faults.test_faults import tally
from tests.helpers import free_port, spawn

FIRST_TOKEN_TIMEOUT_S = 2.0
STALL_TIMEOUT_S = 2.0
LABEL = " (grpc://)"


def body(i: int, **kw: Any) -> dict[str, Any]:
    """The drills' request without its seed: SGLang's protocol carries none, so a sampled request
    with a seed is refused (400 naming ``seed``) in front of these workers."""
    out = seeded_body(i, **kw)
    out.pop("seed")
    return out


@pytest.fixture(scope="module")
def redis_port() -> Iterator[tuple[int, list[subprocess.Popen[bytes]]]]:
    port = free_port()
    procs = [start_redis(port)]
    try:
        yield port, procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def smg(redis_port: tuple[int, list[subprocess.Popen[bytes]]]) -> Iterator[Cluster]:
    port, _ = redis_port
    c = Cluster.create(
        2,
        2,
        ["--time-scale", "10", "--capacity-blocks", "4096"],
        protocol="smg",
        gateway_args=["--redis", f"redis://127.0.0.1:{port}/0"],
        gateway_env={
            "PREFIXGATE_REDIS_PREFIX": f"prefixgate-test-{uuid.uuid4().hex[:8]}:",
            "PREFIXGATE_FIRST_TOKEN_TIMEOUT_S": str(FIRST_TOKEN_TIMEOUT_S),
            "PREFIXGATE_STALL_TIMEOUT_S": str(STALL_TIMEOUT_S),
        },
    )
    c.start()
    try:
        yield c
    finally:
        assert c.stop() == 0


def _node_state(cluster: Cluster, node: NodeProc) -> dict[str, Any]:
    nodes = httpx.get(cluster.url + "/admin/nodes", timeout=5).json()["data"]
    return next(n for n in nodes if n["id"] == node.gateway_id)  # type: ignore[no-any-return]


def _until(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def _all_routable(cluster: Cluster) -> None:
    cluster.wait_routable("prefill", len(cluster.prefill), timeout=20)
    cluster.wait_routable("decode", len(cluster.decode), timeout=20)


def _restart(cluster: Cluster, node: NodeProc) -> None:
    node.start()
    assert _until(lambda: _node_state(cluster, node)["routable"], 20.0), _node_state(cluster, node)


def test_smg_prefill_node_killed_mid_run(smg: Cluster) -> None:
    _all_routable(smg)
    before = smg.metric("prefixgate_retries_total")
    victim = smg.prefill[0]

    def during(done: int) -> None:
        if done == 15:
            victim.kill()

    results = asyncio.run(drive(smg.url, [body(i, tokens=800) for i in range(60)], 8, during=during))
    t = tally("prefill node SIGKILL during 60 requests" + LABEL, results, smg, before)
    assert t.failed == 0 and t.succeeded == 60, [r.error for r in results if r.error][:5]
    assert all(r.route == "disaggregated" for r in results), {r.route for r in results}
    assert victim.proc is not None and victim.proc.proc.returncode == -9
    _restart(smg, victim)


def test_smg_all_prefill_nodes_down_then_back(smg: Cluster) -> None:
    _all_routable(smg)
    before = smg.metric("prefixgate_retries_total")
    for n in smg.prefill:
        n.kill()
    results = asyncio.run(drive(smg.url, [body(1000 + i, tokens=800) for i in range(30)], 6))
    t = tally("all prefill nodes SIGKILL" + LABEL, results, smg, before)
    assert t.failed == 0 and t.succeeded == 30, [r.error for r in results if r.error][:5]
    assert t.fell_back == 30  # every request served whole by a decode node
    for n in smg.prefill:
        n.start()
    deadline = time.monotonic() + 20
    routes: list[str] = []
    while time.monotonic() < deadline:
        res = asyncio.run(drive(smg.url, [body(2000 + len(routes), tokens=800)], 1))
        assert res[0].status == 200, res[0].error
        routes.append(res[0].route)
        if res[0].route == "disaggregated":
            break
        time.sleep(0.2)
    REPORT[-1].note = f"split path back after {len(routes)} probe requests"
    assert routes[-1] == "disaggregated", routes
    _all_routable(smg)


def test_smg_decode_node_killed_mid_stream(smg: Cluster) -> None:
    _all_routable(smg)
    before = smg.metric("prefixgate_retries_total")
    victim = smg.decode[0]

    def during(done: int) -> None:
        if done == 4:
            victim.kill()

    bodies = [body(3000 + i, tokens=800, max_tokens=40) for i in range(24)]
    results = asyncio.run(drive(smg.url, bodies, 12, stream=True, during=during))
    t = tally(
        "decode node SIGKILL mid-run (streaming)" + LABEL,
        results,
        smg,
        before,
        note="streams cut by the kill end with an explicit error event",
    )
    assert t.failed == 0, [r.error for r in results if r.status != 200][:5]
    assert t.silent_truncations == 0
    assert all(r.done_marker for r in results if r.status == 200 and not r.error)
    assert all(r.decode_node == victim.gateway_id for r in results if r.error), (
        "only streams on the dead node break"
    )
    assert t.succeeded + t.stream_errors == 24
    _restart(smg, victim)


def test_smg_hung_prefill_node_fails_over_before_first_token(smg: Cluster) -> None:
    """SIGSTOP on a prefill node under load: both legs of an SGLang PD request wait on it (the
    decode leg for the KV it never sends); the first-token timeout charges the prefill node,
    the request goes to the other prefill node, the probes open the hung node's breaker."""
    _all_routable(smg)
    victim = smg.prefill[0]
    before = smg.metric("prefixgate_retries_total")
    prefill_retries0 = smg.metric("prefixgate_retries_total", stage="prefill")
    decode_opens0 = {n.gateway_id: _node_state(smg, n)["circuit_opens"] for n in smg.decode}
    stopped_at = 0.0

    def during(done: int) -> None:
        nonlocal stopped_at
        if done == 6:
            victim.signal(signal.SIGSTOP)
            stopped_at = time.monotonic()

    try:
        results = asyncio.run(
            drive(smg.url, [body(8000 + i, tokens=800) for i in range(36)], 6, during=during, timeout=20)
        )
        state = _node_state(smg, victim)
        decode_states = [_node_state(smg, n) for n in smg.decode]
        prefill_retries = smg.metric("prefixgate_retries_total", stage="prefill") - prefill_retries0
        # once its breaker is open, no request waits on the hung node
        opened = _until(lambda: _node_state(smg, victim)["circuit"] == "open", 10.0)
        after = asyncio.run(drive(smg.url, [body(8100 + i, tokens=800) for i in range(12)], 6, timeout=20))
    finally:
        victim.signal(signal.SIGCONT)
    slowest = max(r.ended_at - r.started_at for r in results)
    t = tally(
        "prefill node SIGSTOP (hung) under load" + LABEL,
        results,
        smg,
        before,
        note=f"{FIRST_TOKEN_TIMEOUT_S:g} s first-token timeout; breaker opened on the hung node, "
        f"slowest request {slowest:.1f} s",
    )
    assert stopped_at, "the node was stopped mid-run"
    assert t.failed == 0 and t.succeeded == 36, [r.error for r in results if r.error][:5]
    assert t.retried >= 1 and prefill_retries == t.retried, (t.retried, prefill_retries)
    assert state["circuit_opens"] >= 1, state
    assert opened and all(r.status == 200 and r.prefill_node != victim.gateway_id for r in after)
    for d in decode_states:
        assert d["circuit"] == "closed" and d["circuit_opens"] == decode_opens0[d["id"]], d
    assert slowest < FIRST_TOKEN_TIMEOUT_S * 3 + 3, slowest
    assert _until(lambda: _node_state(smg, victim)["routable"], 15.0)
    _all_routable(smg)


def _aborts(node: NodeProc, known: bool = True) -> list[str]:
    """The node's log lines for an ``Abort`` it received (``known``: of a request still running)."""
    assert node.proc is not None
    lines = [line for line in list(node.proc.lines) if '"event": "abort"' in line]
    return [line for line in lines if '"known": true' in line] if known else lines


def test_smg_client_disconnect_during_prefill_aborts_engine_work(smg: Cluster) -> None:
    """Clients that hang up while their prefill runs: the gateway sends ``Abort`` to the engine
    (both legs: the prefill node drops the prefill, the decode node its waiting request), the
    nodes' queues drain and the gateway's in-flight count returns to 0."""
    _all_routable(smg)
    hang_ups, hang_after_s = 4, 0.5
    for n in smg.prefill:  # 10x slower: a 3000-token prefill takes seconds, the clients leave first
        n.signal(signal.SIGUSR1)
    aborts0 = {n.node_id: len(_aborts(n, known=n.role == "prefill")) for n in smg.prefill + smg.decode}

    async def hang_up(i: int) -> None:
        async with httpx.AsyncClient(base_url=smg.url, timeout=30) as http:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(one(http, body(9500 + i, tokens=3000), stream=True), hang_after_s)

    def load() -> tuple[int, int]:
        nodes = httpx.get(smg.url + "/admin/nodes", timeout=5).json()["data"]
        busy = sum(n["load"]["queued_requests"] + n["load"]["running_requests"] for n in nodes)
        return busy, sum(n["load"]["local_requests"] + n["load"]["active_streams"] for n in nodes)

    async def disconnect() -> None:
        await asyncio.gather(*(hang_up(i) for i in range(hang_ups)))

    try:
        asyncio.run(disconnect())
        left_at = time.monotonic()
        idle = _until(
            lambda: (
                load() == (0, 0)
                and smg.metric("prefixgate_inflight_requests") == 0
                and sum(len(_aborts(n)) - aborts0[n.node_id] for n in smg.prefill) >= hang_ups
            ),
            8.0,
        )
        idle_after_s = time.monotonic() - left_at
    finally:
        for n in smg.prefill:
            n.signal(signal.SIGUSR2)
    prefill_aborts = sum(len(_aborts(n)) - aborts0[n.node_id] for n in smg.prefill)
    decode_aborts = sum(len(_aborts(n, known=False)) - aborts0[n.node_id] for n in smg.decode)
    before = smg.metric("prefixgate_retries_total")
    follow = asyncio.run(drive(smg.url, [body(9600 + i, tokens=3000, max_tokens=4) for i in range(2)], 2))
    slowest = max(r.ended_at - r.started_at for r in follow)
    t = tally(
        "clients hang up during prefill" + LABEL,
        follow,
        smg,
        before,
        note=f"{hang_ups} clients left after {hang_after_s:g} s; Abort reached {prefill_aborts} running "
        f"prefill legs ({decode_aborts} decode legs); queues and in-flight 0 after {idle_after_s:.1f} s; "
        f"2 follow-ups in {slowest:.1f} s",
    )
    t.sent += hang_ups
    assert idle, (load(), smg.metric("prefixgate_inflight_requests"), prefill_aborts)
    assert prefill_aborts >= hang_ups, prefill_aborts  # the engine was told while it still worked
    assert decode_aborts >= hang_ups, decode_aborts
    assert t.failed == 0 and t.succeeded == 2
    assert slowest < 5.0, "no orphaned prefills ahead of the follow-ups"


def test_smg_two_gateways_share_the_index_and_route_as_one(
    smg: Cluster, redis_port: tuple[int, list[subprocess.Popen[bytes]]]
) -> None:
    """A second gateway on the same Redis and the same ``grpc://`` workers: a prefix the first
    one routed (its blocks known from the engines' KV events) is sent by the second to the same
    prefill node, and hits there."""
    port, _ = redis_port
    _all_routable(smg)
    b_port = free_port()
    args = ["gateway", "--port", str(b_port), "--redis", f"redis://127.0.0.1:{port}/0"]
    for n in smg.prefill:
        args += ["--prefill", *n.worker_entry]
    for n in smg.decode:
        args += ["--decode", n.address]
    env = {
        k: v for k, v in smg.gateway_env.items() if k in ("PREFIXGATE_REDIS_PREFIX", "PREFIXGATE_TOKENIZER")
    }
    second = spawn(args, env=env)
    b_url = f"http://127.0.0.1:{b_port}"
    try:
        assert _until(lambda: _ready(b_url, len(smg.prefill)), 20.0), list(second.lines)[-20:]
        for seed in range(4):  # several prefixes, so "same node" is not luck
            first = httpx.post(
                smg.url + "/v1/chat/completions", json=body(7500 + seed, tokens=1500), timeout=30
            )
            assert first.status_code == 200, first.text
            time.sleep(0.3)  # the engine's events reach the index off the hot path
            again = httpx.post(
                b_url + "/v1/chat/completions", json=body(7500 + seed, tokens=1500, max_tokens=4), timeout=30
            )
            assert again.status_code == 200, again.text
            assert again.headers["x-prefixgate-prefill-node"] == first.headers["x-prefixgate-prefill-node"]
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        rc = second.stop()
        assert rc == 0, (rc, list(second.lines)[-20:])


def _ready(url: str, prefill: int) -> bool:
    try:
        return bool(httpx.get(url + "/readyz", timeout=1).json().get("prefill") == prefill)
    except (httpx.HTTPError, ValueError):
        return False


def _index_blocks(port: int, prefix: str) -> int:
    async def read() -> int:
        idx = RedisIndex(connect(f"redis://127.0.0.1:{port}/0"), prefix=prefix)
        try:
            return (await idx.stats()).total_blocks
        finally:
            await idx.close()

    return asyncio.run(read())


def test_smg_redis_restarted_empty_index_rebuilt_from_kv_events(
    smg: Cluster, redis_port: tuple[int, list[subprocess.Popen[bytes]]]
) -> None:
    """Redis comes back empty: the gateway notices, resubscribes each engine's
    ``SubscribeKvEvents`` (the subscription opens with the blocks the engine holds) and the index
    holds again what it held; requests meanwhile all succeed."""
    port, procs = redis_port
    prefix = smg.gateway_env["PREFIXGATE_REDIS_PREFIX"]
    _all_routable(smg)
    results = asyncio.run(drive(smg.url, [body(7000 + i, tokens=1500) for i in range(16)], 6))
    assert _until(lambda: _index_blocks(port, prefix) > 0, 5.0)
    time.sleep(0.5)  # the last events land
    held = _index_blocks(port, prefix)
    procs[-1].kill()
    procs[-1].wait()
    procs.append(start_redis(port))  # idle: no request in flight
    t0 = time.monotonic()
    assert _until(lambda: _index_blocks(port, prefix) >= held, 15.0), (held, _index_blocks(port, prefix))
    took = time.monotonic() - t0
    view = httpx.get(smg.url + "/admin/cache", timeout=5).json()
    assert view["index"]["total_blocks"] >= held and not view["index"]["degraded"], view["index"]
    results += asyncio.run(drive(smg.url, [body(7000 + i, tokens=1500) for i in range(16)], 6))
    resynced = smg.metric("prefixgate_index_resyncs_total", reason="index_data_lost")
    repeat = results[16:]
    hits = sum(1 for r in repeat if r.cached_tokens > 0)
    t = Tally("Redis restarted empty (data loss)" + LABEL, len(results))
    t.succeeded = sum(1 for r in results if r.status == 200 and r.finish)
    t.failed = sum(1 for r in results if r.status != 200)
    t.note = (
        f"index rebuilt from SubscribeKvEvents in {took:.1f}s ({int(resynced)} nodes resynced); "
        f"{hits}/16 repeats hit the cache"
    )
    REPORT.append(t)
    assert t.failed == 0 and t.succeeded == 32
    assert resynced >= 4, resynced
    assert hits == 16, [r.cached_tokens for r in repeat]
