"""Fault drills: nodes killed or all down, and a flood past capacity (see ``drills.py``)."""

from __future__ import annotations

import asyncio
import time

from tests.faults.cluster import Cluster, Outcome, drive
from tests.faults.drills import (
    REPORT,
    all_routable,
    body,
    node_state,
    restart,
    tally,
)


def test_prefill_node_killed_mid_run(cluster: Cluster) -> None:
    all_routable(cluster)
    before = cluster.metric("prefixgate_retries_total")
    victim = cluster.prefill[0]

    def during(done: int) -> None:
        if done == 10:
            victim.kill()

    # killed with 8 requests in flight, 12 more to send after: the retries and the routing
    # around the dead node are both exercised; 2 tokens each, the decode leg plays no part
    results = asyncio.run(drive(cluster.url, [body(i, max_tokens=2) for i in range(30)], 8, during=during))
    t = tally("prefill node SIGKILL during 30 requests", results, cluster, before)
    assert t.failed == 0 and t.succeeded == 30, [r.error for r in results if r.error][:5]
    assert all(r.route == "disaggregated" for r in results), {r.route for r in results}
    assert victim.proc is not None and victim.proc.proc.returncode == -9
    restart(cluster, victim)


def test_all_prefill_nodes_down_then_back(cluster: Cluster) -> None:
    all_routable(cluster)
    before = cluster.metric("prefixgate_retries_total")
    for n in cluster.prefill:
        n.kill()
    results = asyncio.run(drive(cluster.url, [body(1000 + i, max_tokens=2) for i in range(12)], 6))
    t = tally("all prefill nodes SIGKILL", results, cluster, before)
    assert t.failed == 0 and t.succeeded == 12, [r.error for r in results if r.error][:5]
    assert t.fell_back == 12  # every request served whole by a decode node
    for n in cluster.prefill:
        n.launch()
    for n in cluster.prefill:
        n.wait_ready()
    deadline = time.monotonic() + 20
    routes: list[str] = []
    while time.monotonic() < deadline:
        res = asyncio.run(drive(cluster.url, [body(2000 + len(routes), max_tokens=2)], 1))
        assert res[0].status == 200, res[0].error
        routes.append(res[0].route)
        if res[0].route == "disaggregated":
            break
        time.sleep(0.2)
    REPORT[-1].note = f"split path back after {len(routes)} probe requests"
    assert routes[-1] == "disaggregated", routes
    all_routable(cluster)  # both back, not only the one that took the probe


def test_decode_node_killed_mid_stream(cluster: Cluster) -> None:
    """20 streams at once, a decode node SIGKILLed while streams are open on it: the generations
    on it migrate to the other decode node (docs/faults.md, After the first token) and every
    stream ends as an unbroken one does, with its finish and [DONE]."""
    all_routable(cluster)
    before = cluster.metric("prefixgate_retries_total")
    migrated = cluster.metric("prefixgate_migrations_total")
    victim = cluster.decode[0]

    def streaming() -> dict[str, int]:
        return {n.gateway_id: node_state(cluster, n)["load"]["active_streams"] for n in cluster.decode}

    async def run() -> list[Outcome]:
        nonlocal victim
        # short prompts: the streams are all open within a moment (few still wait for a first
        # token when the node dies: those are retried); 40 tokens at the nodes' 10x slower pace
        # (~5 s) keep them open for seconds after it
        bodies = [body(3000 + i, tokens=200, max_tokens=40) for i in range(20)]
        streams = asyncio.ensure_future(drive(cluster.url, bodies, 20, stream=True))
        for _ in range(100):  # until most streams are open: the node with the most is killed
            await asyncio.sleep(0.05)
            active = await asyncio.to_thread(streaming)
            if sum(active.values()) >= 16:
                break
        victim = next(n for n in cluster.decode if n.gateway_id == max(active, key=lambda k: active[k]))
        victim.kill()
        return await streams

    try:
        results = asyncio.run(run())
    finally:
        restart(cluster, victim)
    moved = cluster.metric("prefixgate_migrations_total") - migrated
    t = tally(
        "decode node SIGKILL mid-stream (20 streams)",
        results,
        cluster,
        before,
        note=f"{moved:g} streams migrated to the other decode node, none broken",
    )
    assert t.failed == 0, [r.error for r in results if r.status != 200][:5]
    assert t.stream_errors == 0, [r.error for r in results if r.error][:5]
    assert t.silent_truncations == 0
    assert all(r.done_marker and r.finish for r in results)
    assert moved >= 1, moved
    assert t.succeeded == 20


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
