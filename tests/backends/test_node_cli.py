"""``prefixgate node`` / ``python -m prefixgate.backends``: a real process, ready line, Stats,
clean SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import structlog

from prefixgate.backends import errors as node_errors
from prefixgate.backends import node as node_module
from prefixgate.backends.cli import add_node_arguments
from prefixgate.backends.kvpages import parse_scale
from prefixgate.v1 import node_pb2, node_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


async def test_node_process_starts_reports_and_stops_cleanly() -> None:
    cmd = ["-m", "prefixgate.backends", "--role", "decode", "--port", "0", "--node-id", "dec-9"]
    cmd += ["--time-scale", "0", "--kv-scale", "1/1024", "--capacity-blocks", "100"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert ready["event"] == "node_ready" and ready["node_id"] == "dec-9" and ready["role"] == "decode"
        async with grpc.aio.insecure_channel(ready["address"]) as ch:
            st = await node_pb2_grpc.NodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=5)
        assert (st.node_id, st.capacity_blocks, st.kv_format.bytes_per_token) == ("dec-9", 100, 160)
        assert st.instance_id == ready["instance_id"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_port_in_use_exits_nonzero() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "prefixgate.backends", "--role", "prefill", "--port", str(port)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=20)
    assert done.returncode == 1 and b"bind" in done.stderr


def test_arguments() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_node_arguments(parser)
    args = parser.parse_args(["--role", "prefill", "--kv-scale", "0.25", "--profile", "instant"])
    assert (args.kv_scale, args.profile, args.port, args.host) == (0.25, "instant", 0, "127.0.0.1")
    assert parse_scale("1/512") == 1 / 512
    with pytest.raises(SystemExit):
        parser.parse_args(["--role", "router"])


async def test_request_id_reaches_log_lines(nodes, stub, prompt, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    saved = structlog.get_config()
    cap = structlog.testing.LogCapture()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, cap],
        # every level ("prefill done" is a debug line): another test in this process may have set
        # up the gateway's logging, whose wrapper filters below info
        wrapper_class=structlog.make_filtering_bound_logger(0),
        cache_logger_on_first_use=False,
    )
    for module in (node_errors, node_module):  # and a logger it cached then would keep its set-up
        monkeypatch.setattr(module, "log", structlog.get_logger("prefixgate.node"))
    try:
        n = await nodes("prefill")
        tokens, hashes = prompt(100)
        md = (("x-prefixgate-request-id", "req-from-metadata"),)
        await stub(n.address).Prefill(
            node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes), metadata=md
        )
        with pytest.raises(grpc.aio.AioRpcError):
            await stub(n.address).Prefill(node_pb2.PrefillRequest(request_id="req-in-message", tokens=b"xyz"))
    finally:
        structlog.configure(**saved)
    by_event = {e["event"]: e for e in cap.entries}
    assert by_event["prefill done"]["request_id"] == "req-from-metadata"
    assert by_event["request failed"]["request_id"] == "req-in-message"
    assert by_event["prefill done"]["node_id"] == n.node.node_id
