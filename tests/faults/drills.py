"""What every fault drill shares: requests, the tally row, waiting for nodes, the clusters.

Each drill runs once per node protocol: ``prefixgate`` (our own) and ``smg`` (the gateway in front
of ``grpc://`` workers, our nodes serving ``sglang.grpc.scheduler.SglangScheduler``: SGLang PD with
both legs at once and the KV handed over through the prefill node's bootstrap port, token ids in
and out with the tokenizer the nodes ship, the index fed by ``SubscribeKvEvents``). Each drill
module gets one cluster per protocol (2 prefill + 2 decode nodes, a Redis of its own, the
``cluster`` fixture in ``conftest.py``) for all its drills: each drill leaves every node routable
again. The drills are in several modules so that parallel test workers can run them side by side.
Drills that only mean something on one protocol say so.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.faults.cluster import Cluster, NodeProc, Outcome, Tally

#: The drills' rows, printed as one table at the end of the run (``conftest.py``).
REPORT: list[Tally] = []
MODEL = "prefixgate-sim"
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()
PROTOCOLS = ("prefixgate", "smg")


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


def node_state(cluster: Cluster, node: NodeProc) -> dict[str, Any]:
    nodes = httpx.get(cluster.url + "/admin/nodes", timeout=5).json()["data"]
    return next(n for n in nodes if n["id"] == node.gateway_id)  # type: ignore[no-any-return]


def until(cond: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def all_routable(cluster: Cluster) -> None:
    cluster.wait_routable("prefill", len(cluster.prefill), timeout=20)
    cluster.wait_routable("decode", len(cluster.decode), timeout=20)


def restart(cluster: Cluster, node: NodeProc) -> None:
    node.start()
    assert until(lambda: node_state(cluster, node)["routable"], 20.0), node_state(cluster, node)
