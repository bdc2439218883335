"""``prefixgate bench overhead --quick --floor`` and ``bench peers`` (no peer installed) end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefixgate.cli", "bench", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_overhead_quick_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    # two nodes: every router is given both (``direct`` is the first alone); the floor and the
    # essentials relay to the first
    r = bench("overhead", "--quick", "--seconds", "0.3", "--nodes", "2", "--floor", "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["config"]["nodes"] == 2
    cells = report["cells"]
    # prefixgate three times: over HTTP and grpc:// (started as peers are: the worker flag alone)
    # and over its own protocol
    gateways = {"prefixgate-http", "prefixgate-grpc", "prefixgate", "floor", "essentials"}
    assert {c["target"] for c in cells} == {"direct", *gateways}
    assert {(c["clients"], c["stream"]) for c in cells} == {(1, False), (32, False), (1, True), (32, True)}
    for c in cells:
        assert c["ok"] > 0 and c["errors"] == 0
        for key in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms", "req_per_s", "node_cpu_ms_per_req"):
            assert c[key] > 0, key
        if c["target"] in gateways:
            assert c["cpu_ms_per_req"] > 0 and c["added_p50_ms"] is not None
    assert set(report["targets"]) == {"http", "grpc", "floor", "essentials"}
    for name, reference in (("http", "smg"), ("grpc", "smg-grpc")):
        t = report["targets"][name]
        assert t["cpu_ms_per_req_1_client"] > 0 and t["req_s_32_clients"] > 0
        assert t["added_p50_ms_1_client"] is not None
        assert t["stream_added_ttft_p50_ms_1_client"] is not None
        assert t["cpu_ms_per_req_1_client_met"] in (True, False)
        # No peer runs in a quick run: nothing to compare with.
        assert t[f"{reference}_added_p50_ms_1_client"] is None
        assert t["added_p50_ms_1_client_met"] is None
    assert "router overhead (2 nodes" in r.stdout


def test_peers_runs_prefixgate_and_skips_missing_peers(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    r = bench(
        "peers", "--format", "chat", "--requests", "30", "--time-scale", "20", "--nodes", "2",
        "--duration", "4", "--max-output-tokens", "4", "--node-time-scale", "0.05",
        "--peers", "sglang,vllm", "--peers-venv", str(tmp_path / "no-venvs"), "--json", str(out),
        "--variant", "index-only:inflight_prefixes=false",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["skipped"]) == {"sglang", "vllm"}
    assert "not installed" in report["skipped"]["sglang"]
    assert "skipped" in r.stdout
    s = report["policies"]["prefixgate prefixgate"]
    assert s["ok"] > 0 and s["errors"] == 0 and s["hit_rate"] > 0
    assert len(s["work_per_node"]) == 2 and s["router_cpu_ms_per_req"] > 0
    v = report["policies"]["prefixgate (index-only)"]  # the same gateway with one setting changed
    assert v["ok"] > 0 and v["errors"] == 0
    assert report["config"]["variants"] == {"index-only": {"PREFIXGATE_INFLIGHT_PREFIXES": "false"}}
