"""``prefixgate gateway --grpc-port``: one process serves HTTP and gRPC and stops both cleanly."""

from __future__ import annotations

import grpc
import httpx

from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc
from tests.admin.conftest import MODEL
from tests.helpers import free_port, spawn


def test_gateway_command_serves_grpc_beside_http() -> None:
    node = spawn(["node", "--role", "decode", "--node-id", "solo", "--time-scale", "0.05"])
    gw = None
    try:
        address = node.wait_for(r'"event": "node_ready".*"address": "([^"]+)"', timeout=30).group(1)
        http_port, grpc_port = free_port(), free_port()
        gw = spawn(["gateway", "--port", str(http_port), "--grpc-port", str(grpc_port), "--decode", address])
        gw.wait_for(r"grpc_front_started", timeout=30)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            done = gateway_pb2_grpc.GatewayStub(channel).Complete(
                gateway_pb2.CompletionRequest(model=MODEL, prompt="Hello", max_tokens=3), timeout=30
            )
        assert done.text and done.decode_node == "solo"
        assert done.route == "monolithic"  # no prefill pool: served whole by the decode node
        assert httpx.get(f"http://127.0.0.1:{http_port}/healthz", timeout=10).status_code == 200
        assert gw.stop() == 0
        assert any("grpc_front_stopped" in line for line in gw.lines)
    finally:
        if gw is not None:
            gw.stop()
        node.stop()
