"""The OpenAI surface on our nodes' SMG face: ``logit_bias`` applied by the tiny engine and
refused by the simulated one, ``return_logprob`` refused (this face does not return them), and
what the node says it serves in its server info."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from prefixgate.backends.server import NodeServer
from prefixgate.backends.tiny.vocab import OUTPUT_IDS
from tests.backends.conftest import StartNode
from tests.backends.test_smg_protocol import BS, LONG, TINY, collect, request


async def test_tiny_applies_logit_bias_and_refuses_logprobs(nodes: StartNode) -> None:
    ns: NodeServer = await nodes("monolithic", engine=TINY, block_size=BS)
    forced = int(OUTPUT_IDS[9])
    async with grpc.aio.insecure_channel(ns.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        plain = (await collect(stub, request(LONG, max_new=5)))[-1].complete
        biased = (await collect(stub, request(LONG, max_new=5, logit_bias={str(forced): 100.0})))[-1].complete
        assert list(biased.output_ids) == [forced] * 5 and list(plain.output_ids) != [forced] * 5
        req = request(LONG, max_new=2)
        req.return_logprob = True
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprob" in (e.value.details() or "")
        info = MessageToDict((await stub.GetServerInfo(pb.GetServerInfoRequest())).scheduler_info)
        assert info["prefixgate_features"] == ["logit_bias"]


async def test_sim_refuses_logit_bias(nodes: StartNode) -> None:
    ns: NodeServer = await nodes("monolithic", engine="sim", block_size=BS)
    async with grpc.aio.insecure_channel(ns.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request(LONG, max_new=2, logit_bias={"5": 10.0}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sim" in (e.value.details() or "")
        info = MessageToDict((await stub.GetServerInfo(pb.GetServerInfoRequest())).scheduler_info)
        assert info["prefixgate_features"] == []
