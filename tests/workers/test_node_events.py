"""Two gateway workers in front of one of our nodes, which streams KV events: every worker
applies every event to its own index, and nothing of the index goes through the store per
request but one message of the routing worker's prediction.

Each worker routes on an index of its own (``cachetier.replicated``): the nodes' events reach
every worker anyway, so each applies them itself, and the writes a worker makes on its own (its
predictions) are published to the others through the store's pub/sub. Counted at the embedded
store itself (``MONITOR``): no index lookup, no index write, one PUBLISH per request at most. A
worker killed and replaced routes on what the node holds again: its event stream starts with
the node's snapshot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from hashlib import sha1

import httpx
import pytest

from prefixgate.cachetier import redis_scripts_zset as zset
from prefixgate.gateway.ops import processes
from tests.helpers import document, free_port, spawn
from tests.workers.support import Gateway, Monitor

REQUESTS = 30
PUBLISHED_S = 0.5  # a prediction recorded (within 5 ms of the answer) and sent to the other worker
STORED = 'prefixgate_kv_events_total\\{kind="stored"[^}]*\\}'
SNAPSHOTS = 'prefixgate_index_resyncs_total\\{reason="snapshot"\\}'


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    node = spawn(["node", "--role", "monolithic", "--port", "0", "--profile", "instant", "--ready-line"])
    proc = None
    try:
        ready = json.loads(node.wait_for(r'^\{"event": "node_ready".*\}$', timeout=60).group(0))
        port = free_port()
        # --workers 2: two workers whatever this machine's core count
        proc = spawn(["gateway", "--port", str(port), "--workers", "2", "--monolithic", ready["address"]])
        proc.wait_for(r'"event": ?"workers_ready"', timeout=90)
        yield Gateway(proc, f"http://127.0.0.1:{port}")
    finally:
        processes.stop_all([*([proc] if proc else []), node])


def test_a_prefix_served_through_one_worker_is_a_hit_through_the_other(gateway: Gateway) -> None:
    first, other = gateway.served_through_both(document(7, 3000), PUBLISHED_S)
    assert other["predicted_cached_tokens"] >= 2048, (first, other)
    assert other["cached_tokens"] >= 2048


def test_the_store_sees_no_index_traffic_per_request(gateway: Gateway) -> None:
    store = gateway.store()
    index_scripts = {
        sha1(text.encode()).hexdigest() for text in (zset.LOOKUP_LUA, zset.STORE_LUA, zset.EPOCH_LUA)
    }

    def chat(seed: int) -> None:
        body = {
            "model": gateway.model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": document(seed, 600)}],
        }
        with httpx.Client(base_url=gateway.base, timeout=30, trust_env=False) as c:  # a connection each
            r = c.post("/v1/chat/completions", json=body, headers={"connection": "close"})
        assert r.status_code == 200, r.text

    chat(10_000)  # both workers connected to the node's event stream and the store
    time.sleep(1.0)
    before_applied = gateway.metric(STORED)
    with Monitor(store) as monitor:
        for i in range(REQUESTS):
            chat(i)
        deadline = time.monotonic() + 20
        while gateway.metric(STORED) - before_applied < 2 * REQUESTS and time.monotonic() < deadline:
            time.sleep(0.1)  # the events of the last requests are still on their way
        time.sleep(PUBLISHED_S)
    store.close()
    assert gateway.metric(STORED) - before_applied >= 2 * REQUESTS  # each worker applied every event
    names = monitor.names()
    assert 0 < names["PUBLISH"] <= REQUESTS, names  # a prediction each, some batched together
    # no index lookup (script), no index write (MULTI/EXEC of scripts), no index key read: what is
    # left is each worker's once-a-second state (membership, usage), whatever the requests
    assert not [c for c in monitor.commands if len(c) > 1 and c[1].strip('"') in index_scripts]
    assert not [c for c in monitor.commands if any('"prefixgate:nodes"' == a for a in c)]
    assert names["EXEC"] <= names["PUBLISH"] // 3, names


def test_a_worker_killed_and_replaced_routes_on_the_nodes_snapshot(gateway: Gateway) -> None:
    text = document(8, 3000)
    first = gateway.chat(text, "question 0")  # the node holds it, both workers know
    time.sleep(PUBLISHED_S)
    victim = 1 - int(first["worker"])
    snapshots = gateway.metric(SNAPSHOTS)
    gateway.kill_worker(victim)
    deadline = time.monotonic() + 20
    while gateway.metric(SNAPSHOTS) <= snapshots and time.monotonic() < deadline:
        time.sleep(0.1)  # the new worker's event stream starts with the node's snapshot
    assert gateway.metric(SNAPSHOTS) > snapshots
    client, _ = gateway.connect_to(victim)
    try:
        # nothing routed this text since the new worker started: it knows it from the snapshot
        line = gateway.chat_on(client, text, "question 1")
    finally:
        client.close()
    assert line["worker"] == victim
    assert line["predicted_cached_tokens"] >= 2048, line
    assert line["cached_tokens"] >= 2048
