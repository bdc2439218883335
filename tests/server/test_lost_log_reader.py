"""A gateway whose log reader went away (the pipe its output went into has no reader: a log
shipper that died, ``prefixgate gateway | tee`` with ``tee`` killed) keeps serving and still
stops on SIGTERM. Its lines are lost, nothing else: a write that fails is dropped, never raised
into the request or the shutdown that logged it."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.server.piped_gateway import CHAT, piped_gateway


@pytest.mark.parametrize("workers", [1, 2])  # two: the supervisor's own lines too
def test_a_gateway_without_a_log_reader_serves_and_stops(workers: int) -> None:
    with piped_gateway(workers) as gw:
        os.close(gw.read)  # the reader goes: every line written from now on fails (EPIPE)
        gw.read = -1
        for _ in range(6):  # each request logs its line, and the workers are all reached
            with httpx.Client(base_url=gw.base, timeout=10, trust_env=False) as c:
                r = c.post("/v1/chat/completions", json=CHAT, headers={"connection": "close"})
            assert r.status_code == 200, r.text
        gw.proc.send_signal(signal.SIGTERM)  # the shutdown logs too
        assert gw.proc.wait(timeout=30) == 0
