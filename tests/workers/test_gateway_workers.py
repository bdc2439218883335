"""``prefixgate gateway --workers 2`` on the embedded default: the workers route like one gateway.

Behind it, two of our nodes' OpenAI-compatible HTTP endpoints (``--worker-urls``): such workers
publish no KV events, so what a worker knows of the nodes' caches is only what the gateway's
index recorded when it routed. A prefix routed through one worker being a predicted hit
through the other therefore shows that each worker's index learns the others' predictions
(``cachetier.replicated``: published through the store's pub/sub), not only its own.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixgate.gateway.ops import processes
from tests.helpers import document, free_port, spawn
from tests.httpworkers.conftest import Worker, start_node, wait_models
from tests.workers.support import Gateway

MODEL = "m-w"
#: Time for a worker's prediction to reach the other: recorded within 5 ms of the answer, then
#: one message through the store (well under a millisecond on a quiet machine).
PUBLISHED_S = 0.5


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    nodes: list[Worker] = [start_node(MODEL), start_node(MODEL)]
    port = free_port()
    # --workers 2: two workers whatever this machine's core count (the default)
    proc = spawn(["gateway", "--port", str(port), "--workers", "2", "--worker-urls", *[n.url for n in nodes]])
    base = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for(r'"event": ?"workers_ready"', timeout=90)
        wait_models(base, {MODEL})
        yield Gateway(proc, base, MODEL)
    finally:
        processes.stop_all([proc, *[n.proc for n in nodes if n.proc is not None]])


def test_a_prefix_routed_through_one_worker_is_a_hit_through_the_other(gateway: Gateway) -> None:
    first, other = gateway.served_through_both(document(41, 3000), PUBLISHED_S)
    # the first request through the other worker: its index has what the first one predicted
    assert other["predicted_cached_tokens"] >= 2048, (first, other)
    assert other["decode_node"] == first["decode_node"]  # routed to where the prefix is
    assert other["cached_tokens"] > 0  # and the node did hold it

    # a text no worker has seen is cold through either
    cold = gateway.chat(document(42, 3000), "question")
    assert cold["predicted_cached_tokens"] == 0


def test_switches_set_through_one_worker_hold_on_the_other(gateway: Gateway) -> None:
    def seen(client: httpx.Client, value: bool) -> bool:
        deadline = time.monotonic() + 5.0  # at once, or on the membership beat (1 s) at the latest
        while time.monotonic() < deadline:
            if client.get("/admin/switches").json()["normalization"] is value:
                return True
            time.sleep(0.1)
        return False

    with gateway.two_workers() as (here, there):
        assert there.get("/admin/switches").json()["normalization"] is True
        r = here.put("/admin/switches", json={"normalization": False})
        assert r.status_code == 200 and r.json()["normalization"] is False
        assert seen(there, False)
        here.put("/admin/switches", json={"normalization": True})
        assert seen(there, True)


def test_the_admin_cache_view_counts_every_workers_requests(gateway: Gateway) -> None:
    with gateway.two_workers() as (here, there):
        before = here.get("/admin/cache").json()["totals"]
        gateway.chat_on(here, document(300, 200), "hi")
        gateway.chat_on(there, document(301, 200), "hi")
        seen_here = here.get("/admin/cache").json()["totals"]
        seen_there = there.get("/admin/cache").json()["totals"]
    assert seen_here == seen_there  # whichever worker answers
    assert seen_here["requests"] == before["requests"] + 2
    assert seen_here["prompt_tokens"] > before["prompt_tokens"]


def test_metrics_count_every_workers_requests(gateway: Gateway) -> None:
    def total() -> float:
        r = httpx.get(gateway.base + "/metrics", timeout=10, trust_env=False)
        return sum(
            float(m.group(1))
            for m in re.finditer(r'^prefixgate_requests_total\{[^}]*outcome="ok"[^}]*\} (\S+)$', r.text, re.M)
        )

    # a connection to each worker (the kernel may hand many fresh connections to one of them)
    with gateway.two_workers() as (here, there):
        before = total()
        served = [
            gateway.chat_on(c, document(100 + i, 50), "hi")["worker"] for i, c in enumerate([here, there] * 5)
        ]
    assert len(set(served)) == 2
    for _ in range(4):  # whichever worker answers the scrape
        assert total() - before == 10


def test_the_cache_hit_ratio_is_the_gateways_whichever_worker_is_scraped(gateway: Gateway) -> None:
    def ratios(text: str) -> dict[str, float]:
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'^prefixgate_cache_hit_ratio\{source="(\w+)"\} (\S+)$', text, re.M)
        }

    gateway.served_through_both(document(61, 3000), PUBLISHED_S)  # the second a hit, on another worker
    with gateway.two_workers() as (here, there):
        seen = [ratios(c.get("/metrics").text) for c in (here, there)]
        totals = here.get("/admin/cache").json()["totals"]
    assert seen[0] == seen[1]  # each worker once held its own ratio, and the last one written won
    assert (
        seen[0]["reported"] == pytest.approx(totals["hit_ratio_reported"], abs=1e-4)
        and 0 < seen[0]["reported"] < 1
    )
    assert seen[0]["predicted"] == pytest.approx(totals["hit_ratio_predicted"], abs=1e-4)


def test_a_worker_that_dies_is_replaced(gateway: Gateway) -> None:
    victim = gateway.events("worker_started")[-1]
    gateway.kill_worker(int(victim["worker"]))
    exited = [e for e in gateway.events("worker_exited") if e["pid"] == victim["pid"]]
    assert exited and exited[0]["exit_code"] == -signal.SIGKILL
    for i in range(6):  # every connection is still served, by whichever worker
        gateway.chat(document(200 + i, 50), "hi")


def test_sigterm_stops_every_worker_and_the_store(tmp_path: Path) -> None:
    node = start_node(MODEL)
    port = free_port()
    proc = spawn(["gateway", "--port", str(port), "--workers", "2", "--worker-urls", node.url])
    try:
        proc.wait_for(r'"event": ?"workers_ready"', timeout=90)
        store = json.loads(proc.wait_for(r'^\{.*"event": ?"embedded_store_started".*\}$').group(0))
        socket_dir = Path(store["socket"]).parent
        assert socket_dir.exists()
        pids = [int(e["pid"]) for e in Gateway(proc, "").events("worker_started")]
        proc.send_signal(signal.SIGTERM)  # the supervisor alone: it stops the rest
        assert proc.proc.wait(timeout=30) == 0, proc.tail()
        assert not socket_dir.exists()
        for pid in [*pids, int(store["pid"])]:
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"process {pid} outlived the gateway"
    finally:
        processes.stop_all([proc, *([node.proc] if node.proc else [])])


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("stop_at", ["embedded_store_started", "worker_started"])
def test_sigterm_while_the_gateway_starts_is_a_clean_stop(stop_at: str) -> None:
    """A stop asked for while the gateway is still starting (a rollout that changes its mind,
    ``systemctl stop`` right after start) is the stop asked for, not a failure: exit 0, and the
    store, its socket and the workers are gone. Workers still starting end by the signal itself,
    before their own handling of it is set up."""
    node = start_node(MODEL)
    proc = spawn(["gateway", "--port", str(free_port()), "--workers", "2", "--worker-urls", node.url])
    try:
        proc.wait_for(r'^\{.*"event": ?"' + stop_at + r'".*\}$')
        if stop_at == "worker_started":
            proc.wait_for(r'^(?=.*"event": ?"worker_started")(?=.*"worker": ?1\b)')  # both started
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("still running 30 s after SIGTERM:\n" + proc.tail(60))
        assert code == 0, proc.tail()
        gateway = Gateway(proc, "")
        assert not gateway.events("worker_ready"), "the workers were ready: the stop came too late to test"
        stopped = gateway.events("worker_stopped")
        assert {e["exit_code"] for e in stopped} <= {0, -signal.SIGTERM}, stopped
        if stop_at == "worker_started":
            assert len(stopped) == 2, proc.tail()
        store = json.loads(proc.wait_for(r'^\{.*"event": ?"embedded_store_started".*\}$').group(0))
        assert not Path(store["socket"]).parent.exists()
        for pid in [int(store["pid"]), *(int(e["pid"]) for e in gateway.events("worker_started"))]:
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"process {pid} outlived the gateway"
    finally:
        processes.stop_all([proc, *([node.proc] if node.proc else [])])


def test_a_worker_registered_through_one_worker_serves_through_both(gateway: Gateway) -> None:
    """smg's ``POST /workers`` taken by one worker reaches the other through the shared store,
    with what the body said of the worker (its labels here): both route to it."""
    extra = start_node("m-w2")
    try:
        body = {"url": extra.url, "worker_type": "regular", "labels": {"rack": "r7"}}
        with httpx.Client(base_url=gateway.base, timeout=30, trust_env=False) as c:
            r = c.post("/workers", json=body)
        assert r.status_code == 202, r.text
        worker_id = r.json()["worker_id"]
        chat = {"model": "m-w2", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        served: set[int] = set()
        deadline = time.monotonic() + 30
        while len(served) < 2 and time.monotonic() < deadline:
            with httpx.Client(base_url=gateway.base, timeout=30, trust_env=False) as c:
                answer = c.post("/v1/chat/completions", json=chat, headers={"connection": "close"})
                listed = c.get("/workers", headers={"connection": "close"}).json()["workers"]
            if answer.status_code != 200:  # the other worker has not read the record yet (1 s)
                assert answer.status_code in (404, 503), answer.text
                time.sleep(0.2)
                continue
            assert answer.headers["x-prefixgate-decode-node"] == worker_id
            line = gateway.served(answer.headers["x-prefixgate-request-id"])
            served.add(int(line["worker"]))
            mine = [w for w in listed if w["id"] == worker_id]
            assert not mine or mine[0]["metadata"] == {"rack": "r7"}, listed
        assert served == {0, 1}, served
        with httpx.Client(base_url=gateway.base, timeout=30, trust_env=False) as c:
            assert c.delete(f"/workers/{worker_id}").status_code == 202
    finally:
        processes.stop_all([extra.proc] if extra.proc else [])
