"""A gateway whose log reader is alive but stops reading (a log shipper behind, a pager paused)
keeps serving: the pipe fills with some hundred requests' lines, and a blocking write of the
next line once held every request and ``/healthz`` until the reader read again. The lines are
held meanwhile and written, whole and in order, once the reader reads."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.server.piped_gateway import CHAT, piped_gateway

REQUESTS = 300  # some 180 KB of request lines: the pipe (64 KiB) is full long before the last


@pytest.mark.parametrize("workers", [1, 2])
def test_a_gateway_whose_log_reader_stalls_keeps_serving(workers: int) -> None:
    lines: list[bytes] = []
    with piped_gateway(workers) as gw:
        with httpx.Client(base_url=gw.base, timeout=10, trust_env=False) as c:
            for i in range(REQUESTS):
                r = c.post("/v1/chat/completions", json=CHAT)  # the reader reads nothing meanwhile
                assert r.status_code == 200, (i, r.text)
            assert c.get("/healthz").status_code == 200
        read, gw.read = gw.read, -1
        reader = threading.Thread(target=lambda: lines.extend(os.fdopen(read, "rb")), daemon=True)
        reader.start()  # the reader reads again: what was held comes out
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(timeout=30) == 0
        reader.join(timeout=30)
    records = [json.loads(line) for line in lines]  # every line whole
    served = [r for r in records if r.get("event") == "request"]
    assert len(served) == REQUESTS  # none dropped: far below what a process holds
    assert not [r for r in records if r.get("event") == "log_lines_dropped"]
    assert any(r.get("event") == "shutdown_done" for r in records)
