"""Fault drills: nodes slow or wedged, with the drills' quick health probe (see ``drills.py``; the
hung nodes at every default setting are in ``test_hung_at_defaults.py``)."""

from __future__ import annotations

import asyncio
import signal
import time

from tests.faults.cluster import Cluster, Outcome, drive
from tests.faults.drills import (
    all_routable,
    body,
    node_state,
    tally,
    until,
)


def test_slow_prefill_node_loses_traffic(cluster: Cluster) -> None:
    all_routable(cluster)
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
    all_routable(cluster)
    before = cluster.metric("prefixgate_retries_total")
    victim = cluster.decode[-1]
    victim.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert until(lambda: node_state(cluster, victim)["circuit"] == "open", 10.0)
        noticed_s = time.monotonic() - t0
        state = node_state(cluster, victim)
        assert not state["routable"] and not state["healthy"] and state["last_error"]
        # 12 at 8 at once: both decode nodes would be taken if the wedged one were still routable
        results = asyncio.run(drive(cluster.url, [body(6000 + i, max_tokens=2) for i in range(12)], 8))
    finally:
        victim.signal(signal.SIGCONT)
    t = tally(
        "decode node SIGSTOP (wedged)", results, cluster, before, note=f"breaker open after {noticed_s:.1f}s"
    )
    assert t.failed == 0 and t.succeeded == 12
    assert all(r.decode_node and r.decode_node != victim.gateway_id for r in results)
    assert until(lambda: node_state(cluster, victim)["routable"], 15.0)
    # Back, its breaker is half-open: it takes a trial request once the other decode node is
    # busier (equal idle nodes are taken in id order), and the trial closes it; else the next
    # drill finds one decode node taking a single request at a time.
    sent = iter(range(6100, 6300, 2))

    async def trial(k: int) -> None:
        # 16 tokens: ~2 s of decoding, past the trial request's routing
        busy = asyncio.create_task(drive(cluster.url, [body(k, max_tokens=16)], 1, stream=True))
        await asyncio.sleep(0.5)  # streaming on the other node by now
        await drive(cluster.url, [body(k + 1)], 1)
        await busy

    def closed() -> bool:
        asyncio.run(trial(next(sent)))
        return bool(node_state(cluster, victim)["circuit"] == "closed")

    assert until(closed, 15.0), str({k: v for k, v in node_state(cluster, victim).items() if k != "load"})
    all_routable(cluster)
