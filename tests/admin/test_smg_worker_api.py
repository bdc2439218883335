"""smg's worker API on prefixgate: the bodies smg's docs give register workers that then serve,
``GET /workers`` answers in smg's shape, ``DELETE /workers/{id}`` takes one out, a worker's own
API key reaches it, and what prefixgate cannot honour is refused in OpenAI's error format.

Behind it, our nodes' OpenAI-compatible HTTP endpoints; the gateway at its defaults (no admin
token: loopback clients are the admin).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import httpx
import pytest
from openai import OpenAI

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import Handler, free_port, serve_http, spawn
from tests.httpworkers.conftest import Worker, start_node, wait_models

MODEL = "m-smg"
#: smg's docs, "Worker configuration options" (getting-started/multiple-workers), as printed;
#: only the url is ours.
SMG_DOCS_BODY: dict[str, Any] = {
    "url": "http://worker:8000",
    "api_key": "optional-key",
    "runtime": "sglang",
    "worker_type": "regular",
    "priority": 50,
    "cost": 1.0,
    "labels": {"region": "us-east"},
}


class Gateway:
    def __init__(self, proc: Child, base: str, first: Worker, second: Worker) -> None:
        self.proc, self.base, self.first, self.second = proc, base, first, second

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=30, trust_env=False)

    def workers(self) -> list[dict[str, Any]]:
        with self.http() as c:
            r = c.get("/workers")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["total"] == len(body["workers"])
        return list(body["workers"])


@pytest.fixture(scope="module")
def started() -> Iterator[Gateway]:
    first, second = start_node(MODEL), start_node(MODEL)
    procs = [w.proc for w in (first, second) if w.proc is not None]
    port = free_port()
    try:
        proc = spawn(["gateway", "--port", str(port), "--worker-urls", first.url])
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        wait_models(base, {MODEL})
        yield Gateway(proc, base, first, second)
    finally:
        processes.stop_all(reversed(procs))


@pytest.fixture
def gateway(started: Gateway) -> Gateway:
    """The module's gateway, serving its first worker alone as each test begins (a test that
    changes the pool leaves it for the next one to put back)."""
    with started.http() as c:
        for w in started.workers():
            if w["url"] != started.first.url:
                assert c.delete(f"/workers/{w['id']}").status_code == 202
        if not started.workers():
            assert c.post("/workers", json={"url": started.first.url}).status_code == 202
    wait_models(started.base, {MODEL})
    return started


def _chat(base: str) -> dict[str, str]:
    """One chat through the gateway with the openai client; its response headers."""
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
    return dict(raw.headers.items())


def test_the_smg_docs_body_registers_a_worker_that_then_serves(gateway: Gateway) -> None:
    body = copy.deepcopy(SMG_DOCS_BODY) | {"url": gateway.second.url}
    with gateway.http() as c:
        r = c.post("/workers", json=body)
    assert r.status_code == 202, r.text
    added = r.json()
    assert added["status"] == "accepted" and added["url"] == gateway.second.url
    assert r.headers["location"] == added["location"] == f"/workers/{added['worker_id']}"

    listed = {w["url"]: w for w in gateway.workers()}
    assert set(listed) == {gateway.first.url, gateway.second.url}
    mine = listed[gateway.second.url]
    assert mine["id"] == added["worker_id"]
    kind = (mine["worker_type"], mine["connection_mode"], mine["runtime_type"])
    assert kind == ("regular", "http", "sglang")
    assert (mine["priority"], mine["cost"], mine["metadata"]) == (50, 1.0, {"region": "us-east"})
    assert "api_key" not in json.dumps(listed)
    assert listed[gateway.first.url]["worker_type"] == "regular"

    with gateway.http() as c:
        one = c.get(added["location"])
        assert one.status_code == 200 and one.json() == mine
        first_id = listed[gateway.first.url]["id"]
        gone = c.delete(f"/workers/{first_id}")
    assert gone.status_code == 202, gone.text
    assert gone.json()["worker_id"] == first_id
    assert [w["url"] for w in gateway.workers()] == [gateway.second.url]

    # the one worker left is the one registered through smg's API: it serves
    deadline = time.monotonic() + 15
    while not gateway.workers()[0]["is_healthy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    served = _chat(gateway.base)
    assert served["x-prefixgate-decode-node"] == added["worker_id"]


def test_the_minimal_body_registers_and_a_second_time_is_a_conflict(gateway: Gateway) -> None:
    with gateway.http() as c:
        r = c.post("/workers", json={"url": gateway.second.url})
        assert r.status_code == 202, r.text
        again = c.post("/workers", json={"url": gateway.second.url})
        missing = c.delete("/workers/127.0.0.1:1")
    assert again.status_code == 409
    err = again.json()["error"]
    assert (err["param"], err["code"]) == ("url", "worker_exists")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "worker_not_found"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"url": "ftp://h:1"}, "url"),
        ({"worker_type": "encode"}, "worker_type"),
        ({"bootstrap_port": 8998}, "bootstrap_port"),  # a regular worker takes none
        ({"runtime": "trtllm"}, "runtime"),
        ({"connection_mode": "grpc"}, "connection_mode"),
        ({"tokenizer_path": "/models/x"}, "tokenizer_path"),
        ({"health_check_timeout_secs": 5}, "health_check_timeout_secs"),
        ({"dp_aware": True}, "dp_aware"),
        ({"priority": -1}, "priority"),
        ({"labels": {"a": 1}}, "labels"),
        ({"bogus": 1}, "bogus"),
        ({"url": "grpc://127.0.0.1:1", "api_key": "k", "runtime": "sglang"}, "api_key"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(
    gateway: Gateway, change: dict[str, Any], param: str
) -> None:
    body = copy.deepcopy(SMG_DOCS_BODY) | {"url": gateway.second.url} | change
    with gateway.http() as c:
        r = c.post("/workers", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert [w["url"] for w in gateway.workers()] == [gateway.first.url]  # nothing half-registered


class _Recorder(Handler):
    """An OpenAI-compatible server that wants a key: what it was sent is kept."""

    seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.headers.get("authorization"))
        body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        self.reply(200 if self.path.startswith("/v1/models") else 404, body)


def test_a_workers_own_api_key_is_sent_to_it(gateway: Gateway) -> None:
    with serve_http(_Recorder) as url:
        with gateway.http() as c:
            r = c.post("/workers", json=copy.deepcopy(SMG_DOCS_BODY) | {"url": url})
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 10
        while not _Recorder.seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _Recorder.seen and set(_Recorder.seen) == {"Bearer optional-key"}, _Recorder.seen
