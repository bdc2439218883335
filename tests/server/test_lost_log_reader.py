"""A gateway whose log reader went away (the pipe its output went into has no reader: a log
shipper that died, ``prefixgate gateway | tee`` with ``tee`` killed) keeps serving and still
stops on SIGTERM. Its lines are lost, nothing else: a write that fails is dropped, never raised
into the request or the shutdown that logged it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from prefixgate.gateway.ops import processes
from tests.helpers import REPO, free_port, spawn


@pytest.mark.parametrize("workers", [1, 2])
def test_a_gateway_without_a_log_reader_serves_and_stops(workers: int) -> None:
    node = spawn(["node", "--role", "monolithic", "--port", "0", "--profile", "instant", "--ready-line"])
    try:
        address = node.wait_for(r'"event": "node_ready".*"address": "([^"]+)"', timeout=60).group(1)
        port = free_port()
        read, write = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixgate.cli", "gateway", "--port", str(port), "--monolithic", address]
            + (["--workers", str(workers)] if workers > 1 else []),  # two: the supervisor's own lines too
            stdout=write,
            stderr=write,
            cwd=REPO,
        )
        os.close(write)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(base + "/readyz", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            os.close(read)  # the reader goes: every line written from now on fails (EPIPE)
            read = -1
            body = {
                "model": "prefixgate-sim",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            }
            for _ in range(6):  # each request logs its line, and the workers are all reached
                with httpx.Client(base_url=base, timeout=10, trust_env=False) as c:
                    r = c.post("/v1/chat/completions", json=body, headers={"connection": "close"})
                assert r.status_code == 200, r.text
            proc.send_signal(signal.SIGTERM)  # the shutdown logs too
            assert proc.wait(timeout=30) == 0
        finally:
            if read >= 0:
                os.close(read)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        processes.stop_all([node])
