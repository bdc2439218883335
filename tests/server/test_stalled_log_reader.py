"""A gateway whose log reader is alive but stops reading (a log shipper behind, a pager paused)
keeps serving: the pipe fills with some hundred requests' lines, and a blocking write of the
next line once held every request and ``/healthz`` until the reader read again. The lines are
held meanwhile and written, whole and in order, once the reader reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from prefixgate.gateway.ops import processes
from tests.helpers import REPO, free_port, spawn

REQUESTS = 300  # some 180 KB of request lines: the pipe (64 KiB) is full long before the last


@pytest.mark.parametrize("workers", [1, 2])
def test_a_gateway_whose_log_reader_stalls_keeps_serving(workers: int) -> None:
    node = spawn(["node", "--role", "monolithic", "--port", "0", "--profile", "instant", "--ready-line"])
    try:
        address = node.wait_for(r'"event": "node_ready".*"address": "([^"]+)"', timeout=60).group(1)
        port = free_port()
        read, write = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixgate.cli", "gateway", "--port", str(port), "--monolithic", address]
            + (["--workers", str(workers)] if workers > 1 else []),
            stdout=write,
            stderr=write,
            cwd=REPO,
        )
        os.close(write)
        base = f"http://127.0.0.1:{port}"
        lines: list[bytes] = []
        reader = threading.Thread(target=lambda: lines.extend(os.fdopen(read, "rb")), daemon=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(base + "/readyz", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            body = {
                "model": "prefixgate-sim",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            }
            with httpx.Client(base_url=base, timeout=10, trust_env=False) as c:
                for i in range(REQUESTS):
                    r = c.post("/v1/chat/completions", json=body)  # the reader reads nothing meanwhile
                    assert r.status_code == 200, (i, r.text)
                assert c.get("/healthz").status_code == 200
            reader.start()  # the reader reads again: what was held comes out
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            reader.join(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if not reader.is_alive() and not reader.ident:
                os.close(read)
        records = [json.loads(line) for line in lines]  # every line whole
        served = [r for r in records if r.get("event") == "request"]
        assert len(served) == REQUESTS  # none dropped: far below what a process holds
        assert not [r for r in records if r.get("event") == "log_lines_dropped"]
        assert any(r.get("event") == "shutdown_done" for r in records)
    finally:
        processes.stop_all([node])
