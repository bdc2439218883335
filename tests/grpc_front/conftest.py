"""A small stack (1 prefill + 1 decode) whose gRPC front end the tests call with real stubs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest

from prefixgate.gateway.ops.processes import Child
from prefixgate.v1 import gateway_pb2_grpc
from tests.admin.conftest import start_stack, stop_stack


@dataclass
class GrpcStack:
    root: str
    grpc_address: str
    proc: Child
    channel: grpc.Channel

    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        return gateway_pb2_grpc.GatewayStub(self.channel)

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.root, timeout=30)  # no admin token: loopback is enough


@pytest.fixture(scope="module")
def gstack() -> Iterator[GrpcStack]:
    # Decode at half real speed (5 ms a token), so a long generation is still running when cancelled.
    url, proc = start_stack("--prefill", "1", "--decode", "1", "--time-scale", "0.5")
    try:
        address = proc.wait_for(r"gRPC front end on (\S+?)\)", timeout=5).group(1)
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
            yield GrpcStack(url.removesuffix("/v1"), address, proc, channel)
    finally:
        stop_stack(proc)
