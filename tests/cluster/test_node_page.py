"""A node of prefixgate's own protocol whose KV page is not the gateway's block: every request
would carry block hashes it refuses, so the gateway keeps it out of routing and says why."""

from __future__ import annotations

import json
import time

import httpx

from prefixgate.gateway.ops import processes
from tests.admin.conftest import MODEL
from tests.helpers import free_port, spawn


def test_a_node_with_another_page_is_kept_out_with_the_reason() -> None:
    # --block-size 16: the node's page must differ from the gateway's default block (64)
    node = spawn(["node", "--role", "monolithic", "--block-size", "16", "--time-scale", "0.05"])
    gw = None
    try:
        address = node.wait_for(r'"event": "node_ready".*"address": "([^"]+)"', timeout=30).group(1)
        port = free_port()
        gw = spawn(["gateway", "--port", str(port), "--monolithic", address])
        base = f"http://127.0.0.1:{port}"
        gw.wait_until(processes.answers_http(f"{base}/healthz"), 60, "serving")  # it probes before it listens
        gw.wait_for(r'"event": ?"node_refused"', timeout=30)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 300}], "max_tokens": 4}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 503, r.text  # the deployment's fault, not the client's: never a 400
        error = r.json()["error"]
        assert error["type"] == "service_unavailable_error"
        assert "its KV page is 16 tokens and the gateway hashes 64-token blocks" in error["message"]
        listed = httpx.get(f"{base}/admin/nodes", timeout=10).json()["data"]
        assert [(n["reachable"], n["routable"]) for n in listed] == [(True, False)]
        assert "16 tokens" in listed[0]["refused"]
        lines = [json.loads(x) for x in list(gw.lines) if x.startswith("{")]
        refused = [x for x in lines if x.get("event") == "node_refused"]
        assert len(refused) == 1 and refused[0]["address"] == address  # once, not every probe
        time.sleep(1.0)  # two more probes (every 0.5 s): the node is refused once, not at each
        assert sum('"node_refused"' in x for x in list(gw.lines)) == 1
    finally:
        if gw is not None:
            gw.stop()
        node.stop()
