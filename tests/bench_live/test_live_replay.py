"""A tiny live replay against ``prefixgate up``, through ``prefixgate bench replay --mode live``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixgate.bench import replay
from prefixgate.gateway.ops.processes import Child
from tests.helpers import free_port, spawn


@pytest.fixture(scope="module")
def stack() -> Iterator[str]:
    port = free_port()
    proc: Child = spawn(
        ["up", "--port", str(port), "--prefill", "2", "--decode", "2", "--time-scale", "0.05"]
    )
    try:
        m = proc.wait_for(r"prefixgate ready in [0-9.]+s: (http://\S+/v1)", timeout=60)
        yield m.group(1)
    finally:
        proc.stop()


def test_live_replay_of_chat_sessions_hits_the_cache(stack: str, tmp_path: Path) -> None:
    out = tmp_path / "live.json"
    rc = replay.main(
        [
            "--format", "chat", "--requests", "24", "--time-scale", "20",
            "--mode", "live", "--url", stack, "--clients", "8", "--duration", "20",
            "--max-output-tokens", "4", "--request-timeout", "30", "--label", "up",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    s = report["policies"]["up"]
    assert report["config"]["mode"] == "live"
    assert s["ok"] == s["sent"] > 0 and s["errors"] == 0
    assert s["hit_rate"] > 0  # later turns of a session reuse the earlier turns' blocks
    assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"]
    assert sum(s["requests_per_node"].values()) == s["ok"]  # nodes named by the gateway's headers
    assert 0 <= report["bound"]["hit_rate"] <= 1


def test_live_mode_needs_a_url() -> None:
    assert replay.main(["--format", "chat", "--requests", "2", "--mode", "live"]) == 2
