"""Fault injection on real processes: the cluster keeps serving whatever breaks."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.faults.cluster import Cluster, Outcome, Tally, drive, one
from tests.faults.conftest import REPORT

MODEL = "prefixgate-sim"
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()


def prompt(i: int, tokens: int = 3000) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(tokens * 4 // 6))


def body(i: int, tokens: int = 3000, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "seed": i,
        "messages": [{"role": "user", "content": f"request {i}: " + prompt(i, tokens)}],
        **extra,
    }


def tally(
    name: str, results: list[Outcome], cluster: Cluster, retries_before: float, note: str = ""
) -> Tally:
    t = Tally(name, sent=len(results))
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
def cluster() -> Iterator[Cluster]:
    c = Cluster.create(2, 3, ["--time-scale", "0.5", "--capacity-blocks", "4096"])
    c.start()
    try:
        yield c
    finally:
        assert c.stop() == 0


def test_prefill_node_killed_mid_run(cluster: Cluster) -> None:
    before = cluster.metric("prefixgate_retries_total")
    victim = cluster.prefill[0]

    def during(done: int) -> None:
        if done == 40:
            victim.kill()

    results = asyncio.run(drive(cluster.url, [body(i) for i in range(300)], 16, during=during))
    t = tally("prefill node SIGKILL during 300 requests", results, cluster, before)
    assert t.failed == 0 and t.succeeded == 300, [r.error for r in results if r.error][:5]
    assert victim.proc is not None and victim.proc.proc.returncode == -9
    victim.start()  # back for the next scenario
    cluster.wait_routable("prefill", 2)


def test_all_prefill_nodes_down_then_back(cluster: Cluster) -> None:
    before = cluster.metric("prefixgate_retries_total")
    for n in cluster.prefill:
        n.kill()
    results = asyncio.run(drive(cluster.url, [body(1000 + i) for i in range(60)], 8))
    t = tally("all prefill nodes SIGKILL", results, cluster, before)
    assert t.failed == 0 and t.succeeded == 60
    assert t.fell_back == 60  # every request served whole by a decode node
    for n in cluster.prefill:
        n.start()
    deadline = time.monotonic() + 20
    routes: list[str] = []
    while time.monotonic() < deadline:
        res = asyncio.run(drive(cluster.url, [body(2000 + len(routes))], 1))
        routes.append(res[0].route)
        if res[0].route == "disaggregated":
            break
        time.sleep(0.2)
    REPORT[-1].note = f"split path back after {len(routes)} probe requests"
    assert routes[-1] == "disaggregated", routes
    cluster.wait_routable("prefill", 2)  # both back, not only the one that took the probe


def test_decode_node_killed_mid_stream(cluster: Cluster) -> None:
    before = cluster.metric("prefixgate_retries_total")
    victim = cluster.decode[0]

    def during(done: int) -> None:
        if done == 20:
            victim.kill()

    bodies = [body(3000 + i, tokens=1500, max_tokens=120) for i in range(90)]
    results = asyncio.run(drive(cluster.url, bodies, 12, stream=True, during=during))
    t = tally(
        "decode node SIGKILL mid-run (streaming)",
        results,
        cluster,
        before,
        note="streams cut by the kill end with an explicit error event",
    )
    assert t.failed == 0
    assert t.silent_truncations == 0
    assert all(r.done_marker for r in results if r.status == 200 and not r.error)
    assert all(r.decode_node == victim.node_id for r in results if r.error), (
        "only streams on the dead node break"
    )
    assert t.succeeded + t.stream_errors == 90
    victim.start()
    cluster.wait_routable("decode", 3)


def test_slow_prefill_node_loses_traffic(cluster: Cluster) -> None:
    cluster.wait_routable("prefill", 2)
    before = cluster.metric("prefixgate_retries_total")
    slow = cluster.prefill[0]
    healthy = asyncio.run(
        drive(cluster.url, [body(3900 + j, tokens=6000, max_tokens=2) for j in range(16)], 8)
    )
    share_before = sum(r.prefill_node == slow.node_id for r in healthy) / len(healthy)
    slow.signal(signal.SIGUSR1)
    try:
        started = time.monotonic()
        windows: list[tuple[float, str]] = []

        async def trickle() -> list[Outcome]:
            out: list[Outcome] = []
            for k in range(12):
                batch = await drive(
                    cluster.url, [body(4000 + k * 8 + j, tokens=6000, max_tokens=2) for j in range(8)], 8
                )
                out.extend(batch)
                windows.extend((time.monotonic() - started, r.prefill_node) for r in batch)
            return out

        results = asyncio.run(trickle())
    finally:
        slow.signal(signal.SIGUSR2)
    late = [n for ts, n in windows[len(windows) // 2 :]]
    share = late.count(slow.node_id) / len(late)
    early = [n for ts, n in windows[:16]]
    t = tally(
        "prefill node slowed 10x",
        results,
        cluster,
        before,
        note=f"slow node's share: before {share_before:.0%}, first 16 after {early.count(slow.node_id)}/16, "
        f"from {windows[len(windows) // 2][0]:.1f}s on {share:.0%}",
    )
    assert t.failed == 0
    assert share_before >= 0.25, "both nodes take work while healthy"
    assert share < 0.15, t.note


def _node_state(cluster: Cluster, node_id: str) -> dict[str, Any]:
    nodes = httpx.get(cluster.url + "/admin/nodes", timeout=5).json()["data"]
    return next(n for n in nodes if n["id"] == node_id)  # type: ignore[no-any-return]


def _until(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_wedged_decode_node_is_probed_out_and_rejoins(cluster: Cluster) -> None:
    """SIGSTOP: the node's port still accepts connections, nothing answers. The health probe
    (status call with a short timeout) opens its breaker; traffic goes elsewhere; it rejoins."""
    before = cluster.metric("prefixgate_retries_total")
    victim = cluster.decode[2]
    cluster.wait_routable("decode", 3)
    victim.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert _until(lambda: _node_state(cluster, victim.node_id)["circuit"] == "open", 10.0)
        noticed_s = time.monotonic() - t0
        state = _node_state(cluster, victim.node_id)
        assert not state["routable"] and not state["healthy"] and state["last_error"]
        results = asyncio.run(drive(cluster.url, [body(6000 + i, tokens=800) for i in range(40)], 8))
    finally:
        victim.signal(signal.SIGCONT)
    t = tally(
        "decode node SIGSTOP (wedged)", results, cluster, before, note=f"breaker open after {noticed_s:.1f}s"
    )
    assert t.failed == 0 and t.succeeded == 40
    assert all(r.decode_node != victim.node_id for r in results)
    assert _until(lambda: _node_state(cluster, victim.node_id)["routable"], 10.0)
    cluster.wait_routable("decode", 3)


FIRST_TOKEN_TIMEOUT_S = 1.5
STALL_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def quick() -> Iterator[Cluster]:
    """A cluster whose gateway gives up on a silent node within seconds (settings through env)."""
    c = Cluster.create(
        2,
        3,
        ["--time-scale", "10", "--capacity-blocks", "4096"],
        gateway_env={
            "PREFIXGATE_FIRST_TOKEN_TIMEOUT_S": str(FIRST_TOKEN_TIMEOUT_S),
            "PREFIXGATE_STALL_TIMEOUT_S": str(STALL_TIMEOUT_S),
        },
    )
    c.start()
    try:
        yield c
    finally:
        assert c.stop() == 0


def test_hung_prefill_node_fails_over_before_first_token(quick: Cluster) -> None:
    """SIGSTOP on a prefill node under load: requests it holds time out before their first token
    and go to the other prefill node; the probes open the hung node's breaker, not a decode node's."""
    cluster = quick
    cluster.wait_routable("prefill", 2)
    cluster.wait_routable("decode", 3)
    victim = cluster.prefill[0]
    before = cluster.metric("prefixgate_retries_total")
    prefill_retries0 = cluster.metric("prefixgate_retries_total", stage="prefill")
    decode_opens0 = {n.node_id: _node_state(cluster, n.node_id)["circuit_opens"] for n in cluster.decode}
    stopped_at = 0.0

    def during(done: int) -> None:
        nonlocal stopped_at
        if done == 8:
            victim.signal(signal.SIGSTOP)
            stopped_at = time.monotonic()

    try:
        results = asyncio.run(
            drive(cluster.url, [body(8000 + i, tokens=800) for i in range(80)], 8, during=during, timeout=20)
        )
        state = _node_state(cluster, victim.node_id)
        decode_states = [_node_state(cluster, n.node_id) for n in cluster.decode]
        prefill_retries = cluster.metric("prefixgate_retries_total", stage="prefill") - prefill_retries0
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
    assert t.failed == 0 and t.succeeded == 80, [r.error for r in results if r.error][:5]
    assert t.retried >= 1 and prefill_retries == t.retried, (t.retried, prefill_retries)
    late = [r for r in results if r.started_at > stopped_at + 2 * FIRST_TOKEN_TIMEOUT_S + 2]
    assert late and all(r.prefill_node != victim.node_id for r in late)
    assert state["circuit"] == "open" and state["circuit_opens"] >= 1 and not state["routable"], state
    for d in decode_states:
        assert d["circuit"] == "closed" and d["circuit_opens"] == decode_opens0[d["id"]], d
    assert slowest < FIRST_TOKEN_TIMEOUT_S * 3 + 3, slowest
    assert _until(lambda: _node_state(cluster, victim.node_id)["routable"], 10.0)
    cluster.wait_routable("prefill", 2)


def test_hung_decode_node_mid_stream_ends_streams_with_error(quick: Cluster) -> None:
    """SIGSTOP on a decode node with streams open on it: each of those ends with the SSE error
    event within the stall timeout (no [DONE], never silent); other requests avoid the node."""
    cluster = quick
    cluster.wait_routable("prefill", 2)
    cluster.wait_routable("decode", 3)
    before = cluster.metric("prefixgate_retries_total")
    prefill_retries0 = cluster.metric("prefixgate_retries_total", stage="prefill")
    prefill_opens0 = {n.node_id: _node_state(cluster, n.node_id)["circuit_opens"] for n in cluster.prefill}
    first_wave = [body(9000 + i, tokens=800, max_tokens=500) for i in range(12)]
    second_wave = [body(9100 + i, tokens=800, max_tokens=20) for i in range(16)]
    stopped_at = 0.0
    victim = cluster.decode[0]

    def streaming() -> dict[str, int]:
        return {n.node_id: _node_state(cluster, n.node_id)["load"]["active_streams"] for n in cluster.decode}

    async def scenario() -> tuple[list[Outcome], list[Outcome]]:
        nonlocal stopped_at, victim
        streams = asyncio.create_task(drive(cluster.url, first_wave, 12, stream=True, timeout=20))
        for _ in range(50):  # until streams are open on a decode node: that one is stopped
            await asyncio.sleep(0.1)
            active = await asyncio.to_thread(streaming)
            if max(active.values()) >= 3:
                break
        victim = next(n for n in cluster.decode if n.node_id == max(active, key=lambda k: active[k]))
        victim.signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        first = await streams
        second = await drive(cluster.url, second_wave, 8, stream=True, timeout=20)
        return first, second

    try:
        first, second = asyncio.run(scenario())
        opened = _node_state(cluster, victim.node_id)
        prefill_states = [_node_state(cluster, n.node_id) for n in cluster.prefill]
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
    on_victim = [r for r in first if r.decode_node == victim.node_id]
    assert on_victim, "some streams were on the node when it stopped"
    assert t.failed == 0 and t.silent_truncations == 0
    assert all(r.error and not r.done_marker for r in on_victim), [(r.error, r.finish) for r in on_victim]
    assert all(r.decode_node == victim.node_id for r in results if r.error), "only its streams break"
    assert latest < STALL_TIMEOUT_S + 1.5, latest
    assert t.succeeded + t.stream_errors == len(results)
    assert all(r.decode_node != victim.node_id for r in second)
    assert opened["circuit"] == "open" and not opened["routable"], opened
    assert prefill_retries == 0, "a push stuck on the hung decode node is not the prefill node's fault"
    assert all(p["circuit_opens"] == prefill_opens0[p["id"]] for p in prefill_states), prefill_states
    assert _until(lambda: _node_state(cluster, victim.node_id)["routable"], 10.0)
    cluster.wait_routable("decode", 3)


def test_client_disconnect_during_prefill_cancels_node_work() -> None:
    """Clients that hang up while their prefill runs: the nodes drop the work (no orphaned
    prefills queued or running) and the gateway's in-flight count returns to 0."""
    c = Cluster.create(1, 1, ["--time-scale", "36", "--capacity-blocks", "4096"])
    c.start()
    try:
        hang_ups, hang_after_s = 6, 0.5

        async def hang_up(i: int) -> None:
            async with httpx.AsyncClient(base_url=c.url, timeout=30) as http:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(one(http, body(9500 + i, tokens=3000), stream=True), hang_after_s)

        def load(since: float = 0.0) -> tuple[int, int]:
            nodes = httpx.get(c.url + "/admin/nodes", timeout=5).json()["data"]
            if since and any(n["stats_age_s"] > time.monotonic() - since for n in nodes):
                return -1, -1  # a node's figures are older than that
            busy = sum(n["load"]["queued_requests"] + n["load"]["running_requests"] for n in nodes)
            return busy, sum(n["load"]["local_requests"] + n["load"]["active_streams"] for n in nodes)

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

        busy_before = asyncio.run(disconnect())
        left_at = time.monotonic()
        idle = _until(lambda: load(left_at) == (0, 0) and c.metric("prefixgate_inflight_requests") == 0, 5.0)
        idle_after_s = time.monotonic() - left_at
        before = c.metric("prefixgate_retries_total")
        follow = asyncio.run(drive(c.url, [body(9600 + i, tokens=3000, max_tokens=4) for i in range(2)], 2))
        slowest = max(r.ended_at - r.started_at for r in follow)
        t = tally(
            "clients hang up during prefill",
            follow,
            c,
            before,
            note=f"{hang_ups} clients left after {hang_after_s:g} s of a ~1.5 s prefill; node queues and "
            f"gateway in-flight 0 after {idle_after_s:.1f} s; 2 follow-ups served in {slowest:.1f} s",
        )
        t.sent += hang_ups
        assert busy_before >= 2, busy_before
        assert idle, (load(), c.metric("prefixgate_inflight_requests"))
        assert t.failed == 0 and t.succeeded == 2
        assert slowest < 6.0, "no orphaned prefills ahead of the follow-ups"
    finally:
        assert c.stop() == 0


def test_flood_beyond_capacity_gets_429_with_retry_after() -> None:
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
        for wave in range(3):
            results += asyncio.run(
                drive(
                    c.url, [body(5000 + wave * 1000 + i, tokens=2000, max_tokens=16) for i in range(200)], 200
                )
            )
        rss1 = c.gateway_rss_kb()
        t = tally(
            "flood: 600 requests at 200 concurrent",
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
