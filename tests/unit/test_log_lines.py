"""Gateway workers share one stderr: each log line must reach it whole, never cut by a sibling's."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import structlog

from prefixgate.gateway.logging import configure_logging

_WRITER = r"""
import sys
import structlog
from prefixgate.gateway.logging import configure_logging
configure_logging("json")
log = structlog.get_logger("lines")
pad = "y" * 3000
for i in range(2000):
    log.info("line", i=i, pad=pad, writer=sys.argv[1])
"""


def test_three_processes_on_one_pipe_write_whole_lines() -> None:
    r, w = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(k)], stderr=w) for k in range(3)]
    os.close(w)
    seen: dict[str, int] = {}
    with open(r, "rb") as f:
        for raw in f:
            rec = json.loads(raw)  # a line cut by another's would not parse
            seen[rec["writer"]] = seen.get(rec["writer"], 0) + 1
    for p in procs:
        assert p.wait(60) == 0
    assert seen == {"0": 2000, "1": 2000, "2": 2000}


def test_a_stream_without_a_descriptor_still_gets_its_lines() -> None:
    buf = io.StringIO()
    old = sys.stderr
    sys.stderr = buf
    try:
        configure_logging("json")
        structlog.get_logger("lines").info("kept", n=1)
    finally:
        sys.stderr = old
        configure_logging("json")
    (line,) = buf.getvalue().splitlines()
    assert json.loads(line)["event"] == "kept"
