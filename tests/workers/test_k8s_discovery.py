"""Workers found in Kubernetes, pods by label selector, listed and watched.

No kube-apiserver can be installed here (no binary in the package index this machine reaches,
and it needs etcd), so the API is a loopback HTTP server speaking its wire format for pods: the
``PodList`` a list answers (with its ``resourceVersion``), and a watch as a stream of JSON lines
(``ADDED`` / ``MODIFIED`` / ``DELETED`` with the pod object, ``BOOKMARK``, and the ``ERROR`` 410
an expired version gets), from the version asked for. The gateway at its defaults but for the
discovery settings that point it there; our nodes' HTTP endpoints are the pods.
"""

from __future__ import annotations

import copy
import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from prefixgate.gateway.cluster.k8s_discovery import apply_event, pod_worker
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import Handler, free_port, serve_http, spawn
from tests.httpworkers.conftest import start_node

MODEL = "m-k8s"
NAMESPACE = "llm"


def _pod(name: str, port: int, *, ready: bool = True, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"uid-{name}",
            "labels": labels or {"app": "tiny"},
            "annotations": {"prefixgate.io/port": str(port)},
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class _API:
    """Pods, the event log and the version; what list and watch answer."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = 100
        self.pods: dict[str, dict[str, Any]] = {}
        self.log: list[tuple[int, dict[str, Any]]] = []  # (version, event)
        self.lists = 0
        self.expired_below = 0  # a watch from a version below this gets the 410
        self.cut = 0  # raised: the watches open end (as the API ends them at its timeout)

    def change(self, kind: str, pod: dict[str, Any]) -> None:
        with self.cond:
            self.version += 1
            pod = copy.deepcopy(pod)
            pod["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.pods.pop(pod["metadata"]["name"], None)
            else:
                self.pods[pod["metadata"]["name"]] = pod
            self.log.append((self.version, {"type": kind, "object": pod}))
            self.cond.notify_all()


def _matches(pod: dict[str, Any], selector: str) -> bool:
    want = dict(part.split("=", 1) for part in selector.split(",") if part)
    return all(pod["metadata"]["labels"].get(k) == v for k, v in want.items())


def _handler(api: _API) -> type[http.server.BaseHTTPRequestHandler]:
    class API(Handler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            q = {k: v[0] for k, v in parse_qs(url.query).items()}
            if url.path != f"/api/v1/namespaces/{NAMESPACE}/pods":
                self.send_error(404)
                return
            selector = q.get("labelSelector", "")
            if q.get("watch") != "1":
                with api.cond:
                    api.lists += 1
                    items = [p for p in api.pods.values() if _matches(p, selector)]
                    body = {
                        "kind": "PodList",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(api.version)},
                    }
                    self.reply(200, json.dumps({**body, "items": items}).encode())
                return
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            since = int(q.get("resourceVersion") or 0)
            deadline = time.monotonic() + 20
            with api.cond:
                if since < api.expired_below:
                    gone = {
                        "kind": "Status",
                        "code": 410,
                        "reason": "Expired",
                        "message": "too old resource version",
                    }
                    self._line({"type": "ERROR", "object": gone})
                    return
                cut = api.cut
                while time.monotonic() < deadline and api.cut == cut:
                    for version, event in api.log:
                        if version > since and _matches(event["object"], selector):
                            self._line(event)
                            since = version
                    api.cond.wait(0.2)

        def _line(self, event: dict[str, Any]) -> None:
            try:
                self.wfile.write(json.dumps(event).encode() + b"\n")
                self.wfile.flush()
            except OSError:
                pass

    return API


@pytest.fixture
def api() -> Iterator[tuple[_API, str]]:
    state = _API()
    with serve_http(_handler(state)) as url:
        yield state, url


def _nodes(base: str) -> set[str]:
    r = httpx.get(base + "/admin/nodes", timeout=10, trust_env=False)
    return {n["address"] for n in r.json()["data"]}


def _until(check: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_pods_added_made_unready_and_deleted_change_the_pool(api: tuple[_API, str]) -> None:
    state, url = api
    nodes = [start_node(MODEL), start_node(MODEL)]
    ports = [int(w.url.rsplit(":", 1)[1]) for w in nodes]
    state.change("ADDED", _pod("tiny-0", ports[0]))
    state.change("ADDED", _pod("other-0", 1, labels={"app": "other"}))  # another selector's pod
    port = free_port()
    env = {
        "PREFIXGATE_DISCOVERY_KUBERNETES": "regular=app=tiny",
        # the loopback API, its namespace, and our nodes' HTTP endpoints: what a cluster would have
        "PREFIXGATE_DISCOVERY_KUBERNETES_API": url,
        "PREFIXGATE_DISCOVERY_KUBERNETES_NAMESPACE": NAMESPACE,
        "PREFIXGATE_DISCOVERY_KUBERNETES_SCHEME": "http",
    }
    proc: Child = spawn(["gateway", "--port", str(port)], env=env)
    base = f"http://127.0.0.1:{port}"
    one, two = (f"http://127.0.0.1:{p}" for p in ports)
    try:
        proc.wait_until(processes.answers_http(base + "/healthz"), 60)
        _until(lambda: _nodes(base) == {one}, "the listed pod")
        state.change("ADDED", _pod("tiny-1", ports[1]))
        _until(lambda: _nodes(base) == {one, two}, "the added pod (watched)")
        state.change("MODIFIED", _pod("tiny-0", ports[0], ready=False))
        _until(lambda: _nodes(base) == {two}, "the unready pod out")
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30, trust_env=False)
        assert r.status_code == 200 and r.headers["x-prefixgate-decode-node"].endswith(str(ports[1]))
        state.change("MODIFIED", _pod("tiny-0", ports[0]))
        _until(lambda: _nodes(base) == {one, two}, "the pod ready again")
        lists = state.lists
        with state.cond:  # the open watches end, and resuming one is refused as too old
            state.expired_below = state.version + 1_000
            state.cut += 1
            state.cond.notify_all()
        state.change("DELETED", _pod("tiny-1", ports[1]))
        _until(lambda: _nodes(base) == {one}, "the deleted pod out, through a new list")
        assert state.lists > lists
    finally:
        processes.stop_all([proc, *[w.proc for w in nodes if w.proc]])


def test_a_pod_is_a_worker_while_running_ready_and_not_going() -> None:
    pod = _pod("p", 9000)
    assert pod_worker(pod, "monolithic", "grpc://", 8000).address == "grpc://127.0.0.1:9000"  # type: ignore[union-attr]
    pod["metadata"]["annotations"] = {"sglang.ai/bootstrap-port": "8998"}
    found = pod_worker(pod, "prefill", "grpc://", 30000)
    assert (
        found is not None
        and found.address == "grpc://127.0.0.1:30000"
        and found.options.bootstrap_port == 8998
    )
    assert pod_worker(_pod("p", 1, ready=False), "monolithic", "", 1) is None
    going = _pod("p", 1)
    going["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    assert pod_worker(going, "monolithic", "", 1) is None
    pods: dict[str, Any] = {}
    assert (
        apply_event(
            pods,
            {"type": "ADDED", "object": {**pod, "metadata": {**pod["metadata"], "resourceVersion": "7"}}},
        )
        == "7"
    )
    assert list(pods) == ["uid-p"]
    assert apply_event(pods, {"type": "ERROR", "object": {"code": 410}}) is None
