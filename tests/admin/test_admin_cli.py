"""``prefixgate admin`` run as a subprocess against the stack, and the request id in the logs."""

from __future__ import annotations

import json
import subprocess

from prefixgate.gateway.ops import processes
from tests.admin.conftest import ADMIN_TOKEN, MODEL, AdminStack, chat, wait_until
from tests.helpers import REPO, document


def admin_cli(
    stack: AdminStack, *args: str, token: str | None = ADMIN_TOKEN
) -> subprocess.CompletedProcess[str]:
    cmd = processes.prefixgate("admin", "--url", stack.root)
    if token:
        cmd += ["--token", token]
    return subprocess.run(
        [*cmd, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "", "COLUMNS": "200"},
    )


def test_cli_prints_node_and_cache_tables(stack: AdminStack) -> None:
    chat(stack, [{"role": "user", "content": "Table test."}], [{"id": "cli", "text": document(100, 800)}])
    nodes = admin_cli(stack, "nodes")
    assert nodes.returncode == 0, nodes.stderr
    out = nodes.stdout
    assert "Nodes" in out and "CIRCUIT" in out and "KV USED/CAP" in out
    for node in ("prefill-1", "prefill-2", "decode-1", "decode-2"):
        line = next(line for line in out.splitlines() if f" {node} " in line)
        assert "closed" in line and "ok" in line and "/4,096" in line
    cache = admin_cli(stack, "cache")
    assert cache.returncode == 0, cache.stderr
    assert "Index memory:" in cache.stdout and "Hit ratio reported" in cache.stdout
    assert "Cache by node" in cache.stdout and "HIT PREDICTED" in cache.stdout
    assert sum(f" {n} " in cache.stdout for n in ("prefill-1", "prefill-2", "decode-1", "decode-2")) == 4
    print(out)
    print(cache.stdout)


def test_cli_json_lookup_switches_and_errors(stack: AdminStack) -> None:
    as_json = admin_cli(stack, "nodes", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert len(json.loads(as_json.stdout)["data"]) == 4

    lookup = admin_cli(
        stack, "lookup", "--system", "Be brief.", "--message", "user:Hello there", "--document", "d=some text"
    )
    assert lookup.returncode == 0, lookup.stderr
    assert "Decision disaggregated" in lookup.stdout and "Layout" in lookup.stdout
    assert "messages[1]:user" in lookup.stdout

    sw = admin_cli(stack, "switches", "normalization=off")
    assert sw.returncode == 0, sw.stderr
    try:
        shown = json.loads(admin_cli(stack, "switches", "--json").stdout)
        assert shown == {"disaggregation": True, "prefix_routing": True, "normalization": False}
    finally:
        assert admin_cli(stack, "switches", "normalization=on").returncode == 0

    refused = admin_cli(stack, "nodes", token=None)
    assert refused.returncode == 1 and "error 401" in refused.stderr
    usage = admin_cli(stack, "lookup")
    assert usage.returncode == 2 and "--prompt" in usage.stderr
    unreachable = subprocess.run(
        processes.prefixgate("admin", "--url", "http://127.0.0.1:9", "cache"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert unreachable.returncode == 2 and "cannot reach" in unreachable.stderr


def test_cli_evict_and_pin(stack: AdminStack) -> None:
    prompt = document(101, 700)
    pin = admin_cli(stack, "pin", "--prompt", prompt, "--seconds", "5", "--nodes", "2")
    assert pin.returncode == 0, pin.stderr
    assert "Warmed" in pin.stdout and "prefill-1" in pin.stdout and "prefill-2" in pin.stdout
    evict = admin_cli(stack, "evict", "--prompt", prompt, "--json")
    assert evict.returncode == 0, evict.stderr
    out = json.loads(evict.stdout)
    assert out["nodes"]["prefill-1"]["evicted_blocks"] == out["nodes"]["prefill-2"]["evicted_blocks"] > 0


def test_request_id_is_in_every_log_line_of_the_request(stack: AdminStack) -> None:
    rid = "rid-logs-7f3a"
    with stack.http() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Log me."}], "max_tokens": 3},
            headers={"x-request-id": rid},
        )
        assert r.status_code == 200 and r.headers["x-prefixgate-request-id"] == rid
        bad = c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "document_ids": ["nope"]},
            headers={"x-prefixgate-request-id": rid + "-bad"},
        )
        assert bad.status_code == 404 and bad.headers["x-prefixgate-request-id"] == rid + "-bad"

    def mine() -> list[dict[str, object]]:
        return [line for line in stack.log_lines() if str(line.get("request_id", "")).startswith(rid)]

    lines = wait_until(
        lambda: (got := mine()) and any(g.get("event") == "request_failed" for g in got) and got
    )
    assert lines, "no log line carries the request id"
    summary = next(line for line in lines if line.get("event") == "request")
    assert summary["request_id"] == rid and summary["route"] == "disaggregated"
    for key in ("prefill_node", "decode_node", "cached_tokens", "computed_tokens", "ttft_ms", "queue_ms"):
        assert key in summary, key
    assert {"prefill_ms", "transfer_ms", "first_token_ms", "reason", "outcome"} <= set(summary)
    failed = next(line for line in lines if line.get("event") == "request_failed")
    assert failed["request_id"] == rid + "-bad" and failed["status"] == 404
    # No per-request gateway line of the whole run lacks its request id.
    gateway_events = {"request", "request_failed", "node_attempt_failed", "index_lookup_failed"}
    assert all("request_id" in line for line in stack.log_lines() if line.get("event") in gateway_events)
