"""A gateway whose stdout and stderr go into a pipe the test holds: what the log-reader tests
(a reader that goes away, a reader that stalls) start, in front of one instant node."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from prefixgate.gateway.ops import processes
from tests.helpers import REPO, free_port, spawn

CHAT = {"model": "prefixgate-sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class PipedGateway:
    proc: subprocess.Popen[bytes]
    base: str
    read: int  # the pipe's read end: the test's to read, or to close (then -1)


@contextmanager
def piped_gateway(workers: int) -> Iterator[PipedGateway]:
    """The gateway (``--workers`` when more than one: the supervisor's own lines too), ready;
    killed afterwards if still running, and the pipe's read end closed if still open."""
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
        gw = PipedGateway(proc, f"http://127.0.0.1:{port}", read)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(gw.base + "/readyz", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            yield gw
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if gw.read >= 0:
                os.close(gw.read)
    finally:
        processes.stop_all([node])
