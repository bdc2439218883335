"""Two gateway workers in front of a node that streams KV events: both follow the events, one
writes them to the shared store.

Every worker follows every node's events (its local mirror of the index stays current for a
lookup that misses its deadline), but a node's blocks are the same whoever applies them: written
by each worker, N workers would cost the store N times the writes. Counted at the embedded
store itself: per request, the routing worker's record of what it predicted and one write of
the node's STORED event (two workers writing it: three).
"""

from __future__ import annotations

import json
import time

import httpx
import redis

from prefixgate.gateway.ops import processes
from tests.helpers import document, free_port, spawn

REQUESTS = 30


def test_a_nodes_kv_events_are_written_to_the_store_once() -> None:
    node = spawn(["node", "--role", "monolithic", "--port", "0", "--profile", "instant", "--ready-line"])
    gateway = None
    try:
        ready = json.loads(node.wait_for(r'^\{"event": "node_ready".*\}$', timeout=60).group(0))
        port = free_port()
        # --workers 2: two workers whatever this machine's core count
        gateway = spawn(["gateway", "--port", str(port), "--workers", "2", "--monolithic", ready["address"]])
        gateway.wait_for(r'"event": ?"workers_ready"', timeout=90)
        store_line = gateway.wait_for(r'^\{.*"event": ?"embedded_store_started".*\}$').group(0)
        store = redis.Redis(unix_socket_path=json.loads(store_line)["socket"])
        base = f"http://127.0.0.1:{port}"

        def chat(seed: int) -> None:
            body = {
                "model": "prefixgate-sim",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": document(seed, 600)}],
            }
            with httpx.Client(base_url=base, timeout=30, trust_env=False) as c:  # a connection each
                r = c.post("/v1/chat/completions", json=body, headers={"connection": "close"})
            assert r.status_code == 200, r.text

        def transactions() -> int:
            return int(store.info("commandstats").get("cmdstat_exec", {}).get("calls", 0))

        def applied() -> float:
            text = httpx.get(base + "/metrics", timeout=10, trust_env=False).text
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith('prefixgate_kv_events_total{kind="stored"')
            )

        chat(10_000)  # both workers connected to the node's event stream and the store
        time.sleep(1.0)
        before_tx, before_applied = transactions(), applied()
        for i in range(REQUESTS):
            chat(i)
        deadline = time.monotonic() + 20
        while applied() - before_applied < 2 * REQUESTS and time.monotonic() < deadline:
            time.sleep(0.1)  # the events of the last requests are still on their way
        assert applied() - before_applied >= 2 * REQUESTS  # each worker followed every event
        per_request = (transactions() - before_tx) / REQUESTS
        assert per_request <= 2.2, per_request  # prediction + one event write (3 with both writing)
        store.close()
    finally:
        processes.stop_all([*([gateway] if gateway else []), node])
