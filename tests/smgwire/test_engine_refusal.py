"""A prompt longer than the engine's context, over the SMG protocol (``grpc://``) and over
prefixgate.v1 (bare ``HOST:PORT``); the gateway's own window is larger, so only the engine's
context (its GetModelInfo, its NodeStats) can judge it. The real ``openai`` client gets a 400
``context_length_exceeded`` in OpenAI's format naming that context, the gateway's gRPC front
INVALID_ARGUMENT, the node is not blamed for it (its circuit stays closed) and the next ordinary
request is served."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc
from tests.helpers import free_port
from tests.smgwire.conftest import MODEL, StartNode
from tests.smgwire.test_gateway_over_grpc import PROMPT, gateway

CONTEXT_BLOCKS = 8  # the sim node's context: 8 blocks of 16 tokens
LONG = "Tell me about prefix caches and KV pages. " * 40  # a few hundred tokens


@pytest.mark.parametrize(("flag", "scheme"), [("--worker-urls", "grpc://"), ("--monolithic", "")])
async def test_a_prompt_over_the_engines_context_is_the_clients_400(
    nodes: StartNode, flag: str, scheme: str
) -> None:
    node = await nodes("monolithic", capacity_blocks=CONTEXT_BLOCKS)
    address = f"{scheme}{node.address}"
    grpc_port = free_port()
    # our own protocol's nodes take the gateway's block hashes: these nodes have 16-token blocks
    sizes = ["--block-size", "16"] if not scheme else []
    async with gateway(flag, address, "--grpc-port", str(grpc_port), *sizes) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        for stream in (False, True, False, True):  # more refusals than the breaker's threshold
            with pytest.raises(openai.BadRequestError) as info:
                if stream:
                    s = await client.completions.create(model=MODEL, prompt=LONG, max_tokens=4, stream=True)
                    async for _ in s:
                        pass
                else:
                    await client.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
            err = info.value
            assert err.status_code == 400 and err.code == "context_length_exceeded"
            assert err.type == "invalid_request_error"
            assert "largest context available, 128 tokens" in err.message and node.address not in err.message
            assert "127.0.0.1" not in err.message and len(err.message) < 400
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            req = gateway_pb2.CompletionRequest(model=MODEL, prompt=LONG, max_tokens=4)
            with pytest.raises(grpc.aio.AioRpcError) as rpc:
                await gateway_pb2_grpc.GatewayStub(channel).Complete(req, timeout=30)
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "largest context available, 128 tokens" in (rpc.value.details() or "")
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            rows = {n["address"]: n for n in (await http.get("/admin/nodes")).json()["data"]}
        assert rows[address]["circuit"] == "closed"
        ok = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert ok.choices[0].text
        await client.close()
