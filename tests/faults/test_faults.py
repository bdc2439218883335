"""Fault injection on real processes: the cluster keeps serving whatever breaks, on every protocol.

Each drill runs once per node protocol: ``prefixgate`` (our own) and ``smg`` (the gateway in front
of ``grpc://`` workers, our nodes serving ``sglang.grpc.scheduler.SglangScheduler``: SGLang PD with
both legs at once and the KV handed over through the prefill node's bootstrap port, token ids in
and out with the tokenizer the nodes ship, the index fed by ``SubscribeKvEvents``). One cluster per
protocol (2 prefill + 2 decode nodes, a Redis of its own) serves every drill of the module: each
drill leaves every node routable again. Drills that only mean something on one protocol say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from prefixgate.cachetier.redis_index import RedisIndex, connect
from prefixgate.gateway.ops.processes import Child
from tests.faults.cluster import Cluster, NodeProc, Outcome, Tally, drive, one, start_redis
from tests.faults.conftest import REPORT
from tests.helpers import free_port, spawn

MODEL = "prefixgate-sim"
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()
PROTOCOLS = ("prefixgate", "smg")
# Short enough that a hung node is given up on within the drill, long enough that a healthy one
# under the drills' load is never (the nodes run 10x slower than the default profile).
FIRST_TOKEN_TIMEOUT_S = 2.0
STALL_TIMEOUT_S = 2.0


def prompt(i: int, tokens: int) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(tokens * 4 // 6))


def body(i: int, tokens: int = 800, max_tokens: int = 8) -> dict[str, Any]:
    """A request without a seed: SGLang's protocol carries none, so a sampled request with a seed
    is refused (400 naming ``seed``) in front of ``grpc://`` workers."""
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"request {i}: " + prompt(i, tokens)}],
    }


def tally(
    name: str, results: list[Outcome], cluster: Cluster, retries_before: float, note: str = ""
) -> Tally:
    t = Tally(name + (" (grpc://)" if cluster.protocol == "smg" else ""), sent=len(results))
    t.succeeded = sum(1 for r in results if r.status == 200 and not r.error and r.finish)
    t.fell_back = sum(1 for r in results if r.route == "fallback")
    t.rejected_429 = sum(1 for r in results if r.status == 429)
    t.stream_errors = sum(1 for r in results if r.status == 200 and r.error)
    t.failed = sum(1 for r in results if r.status not in (200, 429))
    t.silent_truncations = sum(1 for r in results if r.status == 200 and not r.error and not r.finish)
    t.retried = int(cluster.metric("prefixgate_retries_total") - retries_before)
    t.note = note
    REPORT.append(t)
    return t


@pytest.fixture(scope="module")
def redis_port() -> Iterator[tuple[int, list[Child]]]:
    """A Redis of the module's own (a drill restarts it empty); the list holds its processes."""
    port = free_port()
    procs = [start_redis(port)]
    try:
        yield port, procs
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


@pytest.fixture(scope="module", params=PROTOCOLS)
def cluster(request: pytest.FixtureRequest, redis_port: tuple[int, list[Child]]) -> Iterator[Cluster]:
    port, _ = redis_port
    protocol: str = request.param
    c = Cluster.create(
        2,
        2,
        ["--time-scale", "10", "--capacity-blocks", "4096"],
        protocol=protocol,
        # both clusters share the module's Redis: each its own DB and key prefix
        gateway_args=["--redis", f"redis://127.0.0.1:{port}/{PROTOCOLS.index(protocol) + 1}"],
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


def only_on(cluster: Cluster, protocol: str, why: str) -> None:
    if cluster.protocol != protocol:
        pytest.skip(f"{protocol} only: {why}")


def _node_state(cluster: Cluster, node: NodeProc) -> dict[str, Any]:
    nodes = httpx.get(cluster.url + "/admin/nodes", timeout=5).json()["data"]
    return next(n for n in nodes if n["id"] == node.gateway_id)  # type: ignore[no-any-return]


def _until(cond: Callable[[], object], timeout: float) -> bool:
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


def test_prefill_node_killed_mid_run(cluster: Cluster) -> None:
    _all_routable(cluster)
    before = cluster.metric("prefixgate_retries_total")
    victim = cluster.prefill[0]

    def during(done: int) -> None:
        if done == 15:
            victim.kill()

    results = asyncio.run(drive(cluster.url, [body(i) for i in range(60)], 8, during=during))
    t = tally("prefill node SIGKILL during 60 requests", results, cluster, before)
    assert t.failed == 0 and t.succeeded == 60, [r.error for r in results if r.error][:5]
    assert all(r.route == "disaggregated" for r in results), {r.route for r in results}
    assert victim.proc is not None and victim.proc.proc.returncode == -9
    _restart(cluster, victim)


def test_all_prefill_nodes_down_then_back(cluster: Cluster) -> None:
    _all_routable(cluster)
    before = cluster.metric("prefixgate_retries_total")
    for n in cluster.prefill:
        n.kill()
    results = asyncio.run(drive(cluster.url, [body(1000 + i) for i in range(30)], 6))
    t = tally("all prefill nodes SIGKILL", results, cluster, before)
    assert t.failed == 0 and t.succeeded == 30, [r.error for r in results if r.error][:5]
    assert t.fell_back == 30  # every request served whole by a decode node
    for n in cluster.prefill:
        n.launch()
    for n in cluster.prefill:
        n.wait_ready()
    deadline = time.monotonic() + 20
    routes: list[str] = []
    while time.monotonic() < deadline:
        res = asyncio.run(drive(cluster.url, [body(2000 + len(routes))], 1))
        assert res[0].status == 200, res[0].error
        routes.append(res[0].route)
        if res[0].route == "disaggregated":
            break
        time.sleep(0.2)
    REPORT[-1].note = f"split path back after {len(routes)} probe requests"
    assert routes[-1] == "disaggregated", routes
    _all_routable(cluster)  # both back, not only the one that took the probe


def test_decode_node_killed_mid_stream(cluster: Cluster) -> None:
    _all_routable(cluster)
    before = cluster.metric("prefixgate_retries_total")
    victim = cluster.decode[0]

    def during(done: int) -> None:
        if done == 4:
            victim.kill()

    bodies = [body(3000 + i, max_tokens=40) for i in range(24)]
    results = asyncio.run(drive(cluster.url, bodies, 12, stream=True, during=during))
    t = tally(
        "decode node SIGKILL mid-run (streaming)",
        results,
        cluster,
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
    _restart(cluster, victim)


def test_slow_prefill_node_loses_traffic(cluster: Cluster) -> None:
    _all_routable(cluster)
    before = cluster.metric("prefixgate_retries_total")
    slow = cluster.prefill[0]
    healthy = asyncio.run(drive(cluster.url, [body(3900 + j, max_tokens=2) for j in range(16)], 8))
    share_before = sum(r.prefill_node == slow.gateway_id for r in healthy) / len(healthy)
    slow.signal(signal.SIGUSR1)
    try:
        started = time.monotonic()
        windows: list[tuple[float, str]] = []

        async def trickle() -> list[Outcome]:
            out: list[Outcome] = []
            for k in range(8):
                batch = await drive(cluster.url, [body(4000 + k * 8 + j, max_tokens=2) for j in range(8)], 8)
                out.extend(batch)
                windows.extend((time.monotonic() - started, r.prefill_node) for r in batch)
            return out

        results = asyncio.run(trickle())
    finally:
        slow.signal(signal.SIGUSR2)
    late = [n for ts, n in windows[len(windows) // 2 :]]
    share = late.count(slow.gateway_id) / len(late)
    early = [n for ts, n in windows[:16]]
    t = tally(
        "prefill node slowed 10x",
        results,
        cluster,
        before,
        note=f"slow node's share: before {share_before:.0%}, "
        f"first 16 after {early.count(slow.gateway_id)}/16, "
        f"from {windows[len(windows) // 2][0]:.1f}s on {share:.0%}",
    )
    assert t.failed == 0
    assert share_before >= 0.25, "both nodes take work while healthy"
    assert share < 0.15, t.note


def test_wedged_decode_node_is_probed_out_and_rejoins(cluster: Cluster) -> None:
    """SIGSTOP: the node's port still accepts connections, nothing answers. The health probe
    (status call with a short timeout) opens its breaker; traffic goes elsewhere; it rejoins."""
    _all_routable(cluster)
    before = cluster.metric("prefixgate_retries_total")
    victim = cluster.decode[-1]
    victim.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert _until(lambda: _node_state(cluster, victim)["circuit"] == "open", 10.0)
        noticed_s = time.monotonic() - t0
        state = _node_state(cluster, victim)
        assert not state["routable"] and not state["healthy"] and state["last_error"]
        results = asyncio.run(drive(cluster.url, [body(6000 + i) for i in range(24)], 8))
    finally:
        victim.signal(signal.SIGCONT)
    t = tally(
        "decode node SIGSTOP (wedged)", results, cluster, before, note=f"breaker open after {noticed_s:.1f}s"
    )
    assert t.failed == 0 and t.succeeded == 24
    assert all(r.decode_node != victim.gateway_id for r in results)
    assert _until(lambda: _node_state(cluster, victim)["routable"], 15.0)
    _all_routable(cluster)


def test_hung_prefill_node_fails_over_before_first_token(cluster: Cluster) -> None:
    """SIGSTOP on a prefill node under load: requests it holds time out before their first token
    and go to the other prefill node (over ``grpc://`` both legs of an SGLang PD request wait on
    it, the decode leg for the KV it never sends: the timeout still charges the prefill node);
    the probes open the hung node's breaker, not a decode node's."""
    _all_routable(cluster)
    # the node taking the traffic now (an earlier drill may have left one out of favour)
    warm = asyncio.run(drive(cluster.url, [body(7900 + i) for i in range(6)], 6))
    victim = max(cluster.prefill, key=lambda n: sum(r.prefill_node == n.gateway_id for r in warm))
    before = cluster.metric("prefixgate_retries_total")
    prefill_retries0 = cluster.metric("prefixgate_retries_total", stage="prefill")
    decode_opens0 = {n.gateway_id: _node_state(cluster, n)["circuit_opens"] for n in cluster.decode}
    stopped_at = 0.0

    def during(done: int) -> None:
        nonlocal stopped_at
        if done == 6:
            victim.signal(signal.SIGSTOP)
            stopped_at = time.monotonic()

    try:
        results = asyncio.run(
            drive(cluster.url, [body(8000 + i) for i in range(36)], 6, during=during, timeout=20)
        )
        state = _node_state(cluster, victim)
        decode_states = [_node_state(cluster, n) for n in cluster.decode]
        prefill_retries = cluster.metric("prefixgate_retries_total", stage="prefill") - prefill_retries0
        # once its breaker is open, no request waits on the hung node
        opened = _until(lambda: _node_state(cluster, victim)["circuit"] == "open", 10.0)
        after = asyncio.run(drive(cluster.url, [body(8100 + i) for i in range(12)], 6, timeout=20))
    finally:
        victim.signal(signal.SIGCONT)
    slowest = max(r.ended_at - r.started_at for r in results)
    t = tally(
        "prefill node SIGSTOP (hung) under load",
        results,
        cluster,
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
    assert _until(lambda: _node_state(cluster, victim)["routable"], 15.0)
    _all_routable(cluster)


def test_hung_decode_node_mid_stream_ends_streams_with_error(cluster: Cluster) -> None:
    """SIGSTOP on a decode node with streams open on it: each of those ends with the SSE error
    event within the stall timeout (no [DONE], never silent); other requests avoid the node."""
    # Over grpc:// the requests sent once the node is hung fail instead of going to the other
    # decode node: not yet held there, so the drill runs on our protocol only.
    only_on(cluster, "prefixgate", "grpc:// requests after a decode node hangs still fail")
    _all_routable(cluster)
    before = cluster.metric("prefixgate_retries_total")
    prefill_retries0 = cluster.metric("prefixgate_retries_total", stage="prefill")
    prefill_opens0 = {n.gateway_id: _node_state(cluster, n)["circuit_opens"] for n in cluster.prefill}
    first_wave = [body(9000 + i, max_tokens=500) for i in range(12)]
    second_wave = [body(9100 + i, max_tokens=20) for i in range(12)]
    stopped_at = 0.0
    victim = cluster.decode[0]

    def streaming() -> dict[str, int]:
        return {n.gateway_id: _node_state(cluster, n)["load"]["active_streams"] for n in cluster.decode}

    async def scenario() -> tuple[list[Outcome], list[Outcome]]:
        nonlocal stopped_at, victim
        streams = asyncio.create_task(drive(cluster.url, first_wave, 12, stream=True, timeout=20))
        for _ in range(50):  # until streams are open on a decode node: that one is stopped
            await asyncio.sleep(0.1)
            active = await asyncio.to_thread(streaming)
            if max(active.values()) >= 3:
                break
        victim = next(n for n in cluster.decode if n.gateway_id == max(active, key=lambda k: active[k]))
        victim.signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        first = await streams
        second = await drive(cluster.url, second_wave, 8, stream=True, timeout=20)
        return first, second

    try:
        first, second = asyncio.run(scenario())
        opened = _node_state(cluster, victim)
        prefill_states = [_node_state(cluster, n) for n in cluster.prefill]
        prefill_retries = cluster.metric("prefixgate_retries_total", stage="prefill") - prefill_retries0
    finally:
        victim.signal(signal.SIGCONT)
    results = first + second
    broken = [r for r in first if r.error]
    latest = max((r.ended_at - stopped_at for r in broken), default=0.0)
    t = tally(
        "decode node SIGSTOP mid-stream (hung)",
        results,
        cluster,
        before,
        note=f"{len(broken)} streams on the hung node ended with an error event "
        f"{latest:.1f} s after the stop ({STALL_TIMEOUT_S:g} s stall timeout)",
    )
    on_victim = [r for r in first if r.decode_node == victim.gateway_id]
    assert on_victim, "some streams were on the node when it stopped"
    assert t.failed == 0 and t.silent_truncations == 0
    assert all(r.error and not r.done_marker for r in on_victim), [(r.error, r.finish) for r in on_victim]
    assert all(r.decode_node == victim.gateway_id for r in results if r.error), "only its streams break"
    assert latest < STALL_TIMEOUT_S + 1.5, latest
    assert t.succeeded + t.stream_errors == len(results)
    assert all(r.decode_node != victim.gateway_id for r in second)
    assert opened["circuit"] == "open" and not opened["routable"], opened
    assert prefill_retries == 0, "a push stuck on the hung decode node is not the prefill node's fault"
    assert all(p["circuit_opens"] == prefill_opens0[p["id"]] for p in prefill_states), prefill_states
    assert _until(lambda: _node_state(cluster, victim)["routable"], 15.0)
    _all_routable(cluster)


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
    _all_routable(cluster)
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
        return busy, sum(n["load"]["local_requests"] + n["load"]["active_streams"] for n in nodes)

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
        idle = _until(
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


def test_two_gateways_share_the_index_and_route_as_one(
    cluster: Cluster, redis_port: tuple[int, list[Child]]
) -> None:
    """A second gateway on the same Redis and the same ``grpc://`` workers: a prefix the first
    one routed (its blocks known from the engines' KV events) is sent by the second to the same
    prefill node, and hits there."""
    only_on(cluster, "smg", "the index fed by the engines' KV events (ours: tests/shared_index)")
    _all_routable(cluster)
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
        assert _until(lambda: _ready(b_url, len(cluster.prefill)), 20.0), second.tail(20)
        for seed in range(3):  # several prefixes, so "same node" is not luck
            settled = functools.partial(_index_settled, url, prefix, _index_blocks(url, prefix))
            first = httpx.post(cluster.url + "/v1/chat/completions", json=body(7500 + seed, 1500), timeout=30)
            assert first.status_code == 200, first.text
            # the engine's events reach the index off the hot path: until they have all landed
            assert _until(settled, 10.0), "no KV events indexed"
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


def test_redis_restarted_empty_index_rebuilt_from_kv_events(
    cluster: Cluster, redis_port: tuple[int, list[Child]]
) -> None:
    """Redis comes back empty: the gateway notices, resubscribes each engine's
    ``SubscribeKvEvents`` (the subscription opens with the blocks the engine holds) and the index
    holds again what it held; requests meanwhile all succeed. Last in the module: it empties the
    Redis the other protocol's cluster shares (run after it, by the fixture's order)."""
    only_on(cluster, "smg", "the index rebuilt from SubscribeKvEvents")
    port, procs = redis_port
    url = cluster.gateway_args[1]
    prefix = cluster.gateway_env["PREFIXGATE_REDIS_PREFIX"]
    _all_routable(cluster)
    results = asyncio.run(drive(cluster.url, [body(7000 + i, 1500) for i in range(12)], 6))
    assert _until(lambda: _index_blocks(url, prefix) > 0, 5.0)
    time.sleep(0.5)  # the last events land
    held = _index_blocks(url, prefix)
    procs[-1].stop(signal.SIGKILL)
    procs.append(start_redis(port))  # idle: no request in flight
    t0 = time.monotonic()
    assert _until(lambda: _index_blocks(url, prefix) >= held, 15.0), (held, _index_blocks(url, prefix))
    took = time.monotonic() - t0
    view = httpx.get(cluster.url + "/admin/cache", timeout=5).json()
    assert view["index"]["total_blocks"] >= held and not view["index"]["degraded"], view["index"]
    # one at a time: each goes where its prefix is, never elsewhere for want of a free node
    repeat = asyncio.run(drive(cluster.url, [body(7000 + i, 1500) for i in range(12)], 1))
    results += repeat
    resynced = cluster.metric("prefixgate_index_resyncs_total", reason="index_data_lost")
    hits = sum(1 for r in repeat if r.cached_tokens > 0)
    t = Tally("Redis restarted empty (data loss) (grpc://)", len(results))
    t.succeeded = sum(1 for r in results if r.status == 200 and r.finish)
    t.failed = sum(1 for r in results if r.status != 200)
    t.note = (
        f"index rebuilt from SubscribeKvEvents in {took:.1f}s ({int(resynced)} nodes resynced); "
        f"{hits}/12 repeats hit the cache"
    )
    REPORT.append(t)
    assert t.failed == 0 and t.succeeded == 24
    assert resynced >= 4, resynced
    assert hits == 12, [r.cached_tokens for r in repeat]


def test_flood_beyond_capacity_gets_429_with_retry_after() -> None:
    """The gateway's admission limit, the same on every protocol: run on ours, with a cluster of
    its own (a short queue on the nodes and a low in-flight limit, so a flood overflows them)."""
    c = Cluster.create(
        1,
        1,
        ["--time-scale", "1.0", "--max-queue", "4", "--max-decode-streams", "8"],
        gateway_env={"PREFIXGATE_MAX_INFLIGHT": "24"},
    )
    c.start()
    try:
        rss0 = c.gateway_rss_kb()
        before = c.metric("prefixgate_retries_total")
        results: list[Outcome] = []
        for wave in range(2):
            bodies = [body(5000 + wave * 1000 + i, tokens=2000, max_tokens=16) for i in range(200)]
            results += asyncio.run(drive(c.url, bodies, 200))
        rss1 = c.gateway_rss_kb()
        t = tally(
            "flood: 400 requests at 200 concurrent",
            results,
            c,
            before,
            note=f"gateway RSS {rss0 // 1024} -> {rss1 // 1024} MiB",
        )
        statuses = {r.status for r in results}
        assert statuses <= {200, 429}, statuses
        assert t.rejected_429 > 0 and t.succeeded > 0
        assert all(r.retry_after for r in results if r.status == 429)
        assert rss1 - rss0 < 64 * 1024, (rss0, rss1)
    finally:
        assert c.stop() == 0
