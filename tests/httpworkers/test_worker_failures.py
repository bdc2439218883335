"""HTTP workers that fail or whose client leaves: failover within the model, abort on disconnect."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import Stream
from openai.types.chat import ChatCompletionMessageParam

from prefixgate.gateway.ops.processes import Child
from tests.helpers import document, free_port, spawn
from tests.httpworkers.conftest import Cluster, start_node, wait_models


@pytest.fixture(scope="module")
def slow() -> Iterator[Cluster]:
    """Two ``m-a`` workers at real simulated speed (12 ms a token) behind a gateway."""
    procs: list[Child] = []
    try:
        workers = [start_node("m-a", time_scale=1.0) for _ in range(2)]
        procs += [w.proc for w in workers if w.proc is not None]
        port = free_port()
        gateway = spawn(["gateway", "--port", str(port), "--worker-urls", *(w.url for w in workers)])
        procs.append(gateway)
        base = f"http://127.0.0.1:{port}"
        wait_models(base, {"m-a"})
        yield Cluster(base, gateway, workers)
    finally:
        for p in reversed(procs):
            p.stop()


def load(url: str) -> int:
    with httpx.Client(base_url=url, timeout=5, trust_env=False) as c:
        return int(sum(r["num_reqs"] for r in c.get("/get_load").json()))


def test_a_client_that_leaves_aborts_the_engines_request(slow: Cluster) -> None:
    client = slow.client()
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": document(1, 50)}]
    raw = client.chat.completions.with_raw_response.create(
        model="m-a", messages=messages, max_tokens=4000, stream=True
    )
    node = raw.headers["x-prefixgate-decode-node"]
    worker = next(w for w in slow.workers if w.node_id == node)
    chunks = raw.parse()
    assert isinstance(chunks, Stream)
    next(iter(chunks))
    assert load(worker.url) == 1  # generating: 4000 tokens take 48 s here
    chunks.close()
    deadline = time.monotonic() + 10
    while load(worker.url) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load(worker.url) == 0


def test_a_dead_worker_is_replaced_by_its_models_other_worker(slow: Cluster) -> None:
    client = slow.client()
    dead, alive = slow.workers
    assert dead.proc is not None
    dead.proc.stop(signal.SIGKILL)
    for i in range(4):  # whichever worker routing picks, every request is answered by the live one
        raw = client.chat.completions.with_raw_response.create(
            model="m-a",
            messages=[{"role": "user", "content": document(10 + i, 40)}],
            max_tokens=2,
        )
        assert raw.headers["x-prefixgate-decode-node"] == alive.node_id
        assert raw.parse().choices[0].message.content
    deadline = time.monotonic() + 10  # the next health probe (every 0.5 s) finds it gone
    with slow.admin() as a:
        while True:
            nodes = {n["id"]: n for n in a.get("/admin/nodes").json()["data"]}
            if not nodes[dead.node_id]["reachable"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert not nodes[dead.node_id]["reachable"] and nodes[alive.node_id]["reachable"]


def test_a_worker_added_at_runtime_brings_its_model(slow: Cluster) -> None:
    new = start_node("m-z", time_scale=1.0)
    assert new.proc is not None
    try:
        client = slow.client()
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="m-z", prompt="hello", max_tokens=2)
        with slow.admin() as a:
            r = a.post("/admin/nodes", json={"role": "monolithic", "address": new.url})
            assert r.status_code == 201, r.text
            assert r.json()["models"] == ["m-z"] and r.json()["reachable"]
            bad = a.post("/admin/nodes", json={"role": "monolithic", "address": "ftp://127.0.0.1:1"})
            assert bad.status_code == 400
            split = a.post("/admin/nodes", json={"role": "prefill", "address": "http://127.0.0.1:1"})
            assert split.status_code == 400 and "monolithic" in split.json()["error"]["message"]
        assert "m-z" in {m.id for m in client.models.list().data}
        raw = client.completions.with_raw_response.create(model="m-z", prompt="hello there", max_tokens=2)
        assert raw.headers["x-prefixgate-decode-node"] == new.node_id and raw.parse().choices[0].text
    finally:
        new.proc.stop()
