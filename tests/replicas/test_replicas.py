"""Three gateway replicas (real processes) on a real Redis Cluster behave as one gateway.

One deployment for the module: a 3-master/3-replica Redis Cluster on loopback, two prefill
nodes, one decode node and a spare decode node, and three gateways, each pointed at a different
cluster node, with API keys for two tenants. A prefix stored through one replica is a hit
through the others, a document registered on one is usable on all, a tenant's pin on one
counts (and ends) on all, a node added, drained or removed through one replica's admin API is
so on the others, and usage sums across replicas, tenant by tenant.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from prefixgate.gateway.state.redis_store import RedisState
from tests.cachetier.support import RedisClusterHarness, test_prefix
from tests.faults.cluster import NodeProc
from tests.helpers import REPO, free_port, spawn
from tests.replicas.store_contract import CONTRACT
from tests.shared_index.test_shared_index import MODEL, doc_body

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

ADMIN = {"authorization": "Bearer admin-secret"}
KEY_A = {"authorization": "Bearer key-a"}
KEY_B = {"authorization": "Bearer key-b"}
PIN_QUOTA_BLOCKS = 80  # a 3,000-token document is 46 blocks: one pin fits, two do not


@dataclass
class Deployment:
    cluster: RedisClusterHarness
    prefix: str
    nodes: list[NodeProc]
    spare: NodeProc
    gateways: list[Child]
    urls: list[str]


def _wait(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise TimeoutError(what)


def _ready(url: str) -> bool:
    try:
        r = httpx.get(url + "/readyz", timeout=1)
        return r.status_code == 200 and r.json()["prefill"] == 2
    except httpx.HTTPError:
        return False


def start_gateway(
    cluster: RedisClusterHarness,
    prefix: str,
    nodes: list[NodeProc],
    redis_port: int,
    env_extra: dict[str, str] | None = None,
) -> tuple[Child, str]:
    """A replica: the same nodes, keys and prefix as the others, its own cluster node to ask."""
    port = free_port()
    cmd = ["gateway", "--port", str(port), "--redis", f"redis://127.0.0.1:{redis_port}"]
    cmd += ["--admin-token", "admin-secret", "--api-key", "key-a=tenant-a", "--api-key", "key-b=tenant-b"]
    for n in nodes:
        cmd += [f"--{n.role}", n.address]
    env = {
        "PREFIXGATE_REDIS_PREFIX": prefix,
        "PREFIXGATE_STATS_INTERVAL_S": "0.2",
        "PREFIXGATE_MEMBERSHIP_INTERVAL_S": "0.2",
        "PREFIXGATE_USAGE_FLUSH_S": "0.2",
        "PREFIXGATE_PIN_QUOTA_BLOCKS": str(PIN_QUOTA_BLOCKS),
        **(env_extra or {}),
    }
    return spawn(cmd, env=env), f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    cluster = RedisClusterHarness().start()
    prefix = test_prefix()
    args = ["--time-scale", "0.05"]
    nodes = [
        NodeProc("prefill", "prefill-1", free_port(), args),
        NodeProc("prefill", "prefill-2", free_port(), args),
    ]
    nodes.append(NodeProc("decode", "decode-1", free_port(), args))
    spare = NodeProc("decode", "decode-2", free_port(), args)
    gateways: list[Child] = []
    urls: list[str] = []
    try:
        for n in [*nodes, spare]:
            n.start()
        for i in range(3):
            gw, url = start_gateway(cluster, prefix, nodes, cluster.ports[i])
            gateways.append(gw)
            urls.append(url)
        for url, gw in zip(urls, gateways, strict=True):
            _wait(partial(_ready, url), "gateway not ready:\n" + "\n".join(list(gw.lines)[-20:]), 30)
        yield Deployment(cluster, prefix, nodes, spare, gateways, urls)
    finally:
        procs = [gw.proc for gw in gateways] + [n.proc.proc for n in [*nodes, spare] if n.proc is not None]
        for proc in procs:  # all at once: each stop waits for its process alone
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for gw in gateways:
            gw.stop()
        for n in [*nodes, spare]:
            n.stop()
        state = RedisState(cluster.url, prefix=prefix)
        asyncio.run(_purge(state))
        cluster.stop()


async def _purge(state: RedisState) -> None:
    try:
        await state.purge()
    finally:
        await state.close()


def chat(url: str, body: dict[str, Any], headers: dict[str, str] = KEY_A) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_the_store_contract_on_the_cluster(deployment: Deployment) -> None:
    async def run() -> None:
        for check in CONTRACT:
            state = RedisState(deployment.cluster.url, prefix=test_prefix())
            try:
                await check(state)
                assert await state.purge() > 0
                assert await state.purge() == 0  # every family, on every shard, went
            finally:
                await state.close()

    asyncio.run(run())


def test_a_prefix_stored_through_one_replica_is_a_hit_through_the_others(deployment: Deployment) -> None:
    g0, g1, g2 = deployment.urls
    first = chat(g0, doc_body(1, question="first question"))
    node = first.headers["x-prefixgate-prefill-node"]
    time.sleep(0.4)  # the index writer batches off the request path
    for url in (g1, g2):
        again = chat(url, doc_body(1, question=f"a question through {url}"))
        assert again.headers["x-prefixgate-prefill-node"] == node
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2_000
    other = chat(g1, doc_body(1, question="first question"), KEY_B)  # same text, another tenant
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_document_registered_on_one_replica_is_usable_on_all(deployment: Deployment) -> None:
    g0, g1, g2 = deployment.urls
    text = doc_body(2)["documents"][0]["text"]
    r = httpx.post(g0 + "/v1/documents", json={"id": "handbook", "text": text}, headers=KEY_A, timeout=5)
    assert r.status_code == 201, r.text
    got = httpx.get(g1 + "/v1/documents/handbook", headers=KEY_A, timeout=5)
    assert got.status_code == 200 and got.json()["text"] == text
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Summarize."}]}
    by_id = chat(g2, {**body, "document_ids": ["handbook"]})
    inline = chat(g0, {**body, "documents": [{"id": "handbook", "text": text}]})
    assert by_id.json()["usage"]["prompt_tokens"] == inline.json()["usage"]["prompt_tokens"]
    assert inline.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prefix
    # Tenant B sees none of it, on any replica.
    assert httpx.get(g1 + "/v1/documents/handbook", headers=KEY_B, timeout=5).status_code == 404
    refused = httpx.post(
        g2 + "/v1/chat/completions", json={**body, "document_ids": ["handbook"]}, headers=KEY_B, timeout=5
    )
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "document_not_found"
    assert httpx.delete(g2 + "/v1/documents/handbook", headers=KEY_B, timeout=5).status_code == 404
    assert httpx.delete(g2 + "/v1/documents/handbook", headers=KEY_A, timeout=5).status_code == 200
    assert httpx.get(g0 + "/v1/documents/handbook", headers=KEY_A, timeout=5).status_code == 404


def _pins(url: str, tenant: str) -> list[dict[str, Any]]:
    r = httpx.get(url + "/admin/cache/pins", params={"tenant": tenant}, headers=ADMIN, timeout=5)
    assert r.status_code == 200, r.text
    rows: list[dict[str, Any]] = r.json()["data"]
    return rows


def test_a_pin_set_on_one_replica_is_seen_on_all_counts_on_all_and_expires(deployment: Deployment) -> None:
    g0, g1, g2 = deployment.urls

    def pin(url: str, seed: int, seconds: float) -> httpx.Response:
        body = {**doc_body(seed), "pin_seconds": seconds}
        return httpx.post(url + "/v1/prefill", json=body, headers=KEY_A, timeout=30)

    first = pin(g0, 3, 4.0)
    assert first.status_code == 200, first.text
    blocks = first.json()["blocks"]
    assert blocks <= PIN_QUOTA_BLOCKS < 2 * blocks
    for url in (g1, g2):
        (row,) = _pins(url, "tenant-a")
        assert row["blocks"] == blocks and row["until"] > time.time()
    assert _pins(g1, "tenant-b") == []
    over = pin(g1, 4, 4.0)  # another prefix through another replica: over the tenant's quota
    assert over.status_code == 429 and over.json()["error"]["code"] == "pin_quota_exceeded", over.text
    assert int(over.headers["retry-after"]) >= 1
    _wait(lambda: _pins(g2, "tenant-a") == [], "the pin did not expire", timeout=10)
    again = pin(g2, 4, 1.0)  # the quota is back once the pin ended, on every replica
    assert again.status_code == 200, again.text


def _node_ids(url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(url + "/admin/nodes", headers=ADMIN, timeout=5)
    assert r.status_code == 200, r.text
    return {n["id"]: n for n in r.json()["data"]}


def _routable(url: str, node: str) -> bool:
    return bool(_node_ids(url).get(node, {}).get("routable", False))


def _draining(url: str, node: str) -> bool:
    return bool(_node_ids(url)[node]["draining"])


def _gone_and_undrained(url: str) -> bool:
    nodes = _node_ids(url)
    return "decode-2" not in nodes and not nodes["decode-1"]["draining"]


def test_a_node_added_through_one_replica_is_routed_to_by_the_others(deployment: Deployment) -> None:
    g0, g1, g2 = deployment.urls
    spare = deployment.spare
    r = httpx.post(
        g0 + "/admin/nodes", json={"role": "decode", "address": spare.address}, headers=ADMIN, timeout=5
    )
    assert r.status_code == 201, r.text
    for url in (g1, g2):
        _wait(partial(_routable, url, "decode-2"), f"decode-2 not on {url}")
    # Drained through another replica: every replica sends decode work to the new node only.
    assert httpx.post(g1 + "/admin/nodes/decode-1/drain", headers=ADMIN, timeout=5).status_code == 200
    for url in (g0, g2):
        _wait(partial(_draining, url, "decode-1"), f"decode-1 not drained on {url}")
    for i, url in enumerate((g0, g1, g2)):
        routed = chat(url, doc_body(10 + i, tokens=600))
        assert routed.headers["x-prefixgate-decode-node"] == "decode-2"
    # A replica started now, with only the original nodes on its command line, agrees at once.
    late, late_url = start_gateway(
        deployment.cluster, deployment.prefix, deployment.nodes, deployment.cluster.ports[3]
    )
    try:
        _wait(partial(_ready, late_url), "the late replica is not ready", 30)
        nodes = _node_ids(late_url)
        assert nodes["decode-1"]["draining"] and "decode-2" in nodes
        assert (
            chat(late_url, doc_body(14, tokens=600), KEY_B).headers["x-prefixgate-decode-node"] == "decode-2"
        )
    finally:
        assert late.stop() == 0
    assert (
        httpx.post(
            g2 + "/admin/nodes/decode-1/drain", json={"drain": False}, headers=ADMIN, timeout=5
        ).status_code
        == 200
    )
    removed = httpx.delete(g1 + "/admin/nodes/decode-2", headers=ADMIN, timeout=5)
    assert removed.status_code == 200, removed.text
    for url in (g0, g2):
        _wait(partial(_gone_and_undrained, url), f"decode-2 still on {url}")
    assert chat(g0, doc_body(13, tokens=600)).headers["x-prefixgate-decode-node"] == "decode-1"


def _switched(url: str, on: bool) -> bool:
    """Whether ``prefix_routing`` is ``on`` at ``url``."""
    r = httpx.get(url + "/admin/switches", headers=ADMIN, timeout=5)
    assert r.status_code == 200, r.text
    return bool(r.json()["prefix_routing"]) is on


def test_switches_set_through_one_replica_hold_on_all(deployment: Deployment) -> None:
    g0, g1, g2 = deployment.urls
    r = httpx.put(g1 + "/admin/switches", json={"prefix_routing": False}, headers=ADMIN, timeout=5)
    assert r.status_code == 200 and r.json()["prefix_routing"] is False
    for url in (g0, g2):
        _wait(partial(_switched, url, False), f"prefix_routing still on at {url}")
    r = httpx.put(g2 + "/admin/switches", json={"prefix_routing": True}, headers=ADMIN, timeout=5)
    assert r.status_code == 200
    for url in (g0, g1):  # the last change wins
        _wait(partial(_switched, url, True), f"prefix_routing still off at {url}")


def _usage(url: str, tenant: str) -> dict[str, Any]:
    r = httpx.get(url + "/admin/usage", params={"tenant": tenant}, headers=ADMIN, timeout=5)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_usage_sums_across_replicas_per_tenant(deployment: Deployment) -> None:
    urls = deployment.urls
    before = _usage(urls[0], "tenant-a")["totals"]
    sent = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
    for i in range(6):  # two a replica, half of them repeating a prefix
        r = chat(urls[i % 3], doc_body(20 + i // 2, tokens=800, question=f"q{i}")).json()["usage"]
        sent["requests"] += 1
        sent["prompt_tokens"] += r["prompt_tokens"]
        sent["cached_tokens"] += r["prompt_tokens_details"]["cached_tokens"]
        sent["output_tokens"] += r["completion_tokens"]
    assert sent["cached_tokens"] > 0
    chat(urls[1], doc_body(30, tokens=300), KEY_B)

    def summed() -> bool:
        now = _usage(urls[2], "tenant-a")["totals"]
        return all(now[k] - before[k] == v for k, v in sent.items())

    _wait(summed, "usage of the three replicas did not add up", timeout=5)
    report = _usage(urls[1], "tenant-a")
    assert {row["tenant"] for row in report["data"]} == {"tenant-a"}
    (row,) = report["data"]
    assert row["model"] == MODEL and row["computed_tokens"] == row["prompt_tokens"] - row["cached_tokens"]
    prices = report["prices"]
    assert prices == {
        "currency": "CNY",
        "per_million_tokens": {"input_miss": 8.0, "input_hit": 2.0, "output": 0.0},
    }
    expected = (row["computed_tokens"] * 8.0 + row["cached_tokens"] * 2.0) / 1e6
    assert row["value"]["total"] == pytest.approx(expected, abs=1e-5)
    # A tenant's own view: its figures only, whichever replica answers and whatever it asks for.
    own = httpx.get(urls[0] + "/v1/usage", params={"tenant": "tenant-a"}, headers=KEY_B, timeout=5).json()
    assert {r["tenant"] for r in own["data"]} == {"tenant-b"} and own["totals"]["requests"] >= 1
    assert httpx.get(urls[0] + "/admin/usage", headers=KEY_B, timeout=5).status_code == 401
    # Prometheus: each replica counts what it served; the three sum to the shared figure (the
    # replica started and stopped in the membership test served tenant B only).
    final = _usage(urls[0], "tenant-a")["totals"]
    for metric, key in (
        ("prefixgate_tenant_prompt_tokens_total", "prompt_tokens"),
        ("prefixgate_tenant_cached_tokens_total", "cached_tokens"),
    ):
        assert sum(_metric(u, metric, tenant="tenant-a") for u in urls) == final[key]
    # The command line shows the same.
    cli = subprocess.run(
        processes.prefixgate("admin", "usage", "--tenant", "tenant-a", "--json"),
        env={"PREFIXGATE_ADMIN_URL": urls[2], "PREFIXGATE_ADMIN_TOKEN": "admin-secret", "PATH": ""},
        cwd=REPO,
        capture_output=True,
        timeout=30,
        check=True,
    )
    assert json.loads(cli.stdout)["totals"] == final


#: Every stage a replica's shutdown logs (docs/faults.md, Shutdown), in order.
SHUTDOWN_STAGES = [
    "http",
    "discovery",
    "membership",
    "usage",
    "rate_limits",
    "pipeline",
    "tokenizer_processes",
    "kv_events",
    "nodes",
    "index",
    "state",
    "loop",
]


def _shutdown_log(gateway: Child) -> list[dict[str, Any]]:
    return [
        rec
        for line in list(gateway.lines)
        if line.startswith("{") and (rec := json.loads(line)).get("event", "").startswith("shutdown_")
    ]


def test_a_replica_shuts_down_within_a_bound_naming_each_stage(deployment: Deployment) -> None:
    """SIGTERM while the shared-state loops talk to the Cluster: every loop ends though a
    cancellation arriving mid-command can be lost (``cachetier.tasks``), each stage is logged
    with its time, and the process exits 0 at once."""
    # the membership and usage loops every millisecond (defaults 1 s), so that at SIGTERM they
    # are almost always in the middle of a call to the Cluster
    fast = {"PREFIXGATE_MEMBERSHIP_INTERVAL_S": "0.001", "PREFIXGATE_USAGE_FLUSH_S": "0.001"}
    for cycle in range(2):  # two replicas in turn: a lost cancellation is likely, not certain
        port = deployment.cluster.ports[4 + cycle]
        gw, url = start_gateway(deployment.cluster, deployment.prefix, deployment.nodes, port, fast)
        try:
            _wait(partial(_ready, url), "the replica is not ready", 30)
            assert chat(url, doc_body(40 + cycle, tokens=600)).status_code == 200
            time.sleep(0.5)
            gw.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            code = gw.proc.wait(20)
            took = time.monotonic() - t0
        finally:
            gw.stop()
        log = _shutdown_log(gw)
        stages = [r for r in log if r["event"] == "shutdown_stage"]
        assert [r["stage"] for r in stages] == SHUTDOWN_STAGES, log
        slow = [
            (r["stage"], r["seconds"], r["outcome"])
            for r in stages
            if r["outcome"] != "ok" or r["seconds"] > 1
        ]
        assert not slow, (slow, [r for r in log if r["event"] == "shutdown_stage_stuck"])
        assert code == 0 and took < 5, (code, took)
