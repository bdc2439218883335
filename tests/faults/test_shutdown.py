"""Graceful shutdown: SIGTERM stops accepting and lets in-flight streams finish."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from tests.faults.cluster import Cluster

MODEL = "prefixgate-sim"


def test_sigterm_finishes_inflight_streams_and_refuses_new_work() -> None:
    c = Cluster.create(1, 1, ["--time-scale", "1.0"])
    c.start()
    try:
        lines: list[str] = []
        first_chunk = threading.Event()

        def stream() -> None:
            body = {
                "model": MODEL,
                "max_tokens": 150,
                "stream": True,
                "seed": 3,
                "messages": [{"role": "user", "content": "tell a long story " * 50}],
            }
            with httpx.stream("POST", c.url + "/v1/chat/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first_chunk.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first_chunk.wait(10)
        assert c.gateway is not None
        c.gateway.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = False
        try:
            httpx.get(c.url + "/healthz", timeout=2)
        except httpx.HTTPError:
            refused = True
        t.join(30)
        assert refused, "a draining gateway must not accept new connections"
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert any('"finish_reason":"length"' in ln or '"finish_reason":"stop"' in ln for ln in lines)
        assert c.gateway.proc.wait(15) == 0
    finally:
        c.stop()
