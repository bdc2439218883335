"""The OpenAI surface on our nodes' SMG face: ``logit_bias`` and output log probabilities from
the tiny engine (on a split request too: the decode leg reports them all), both refused by the
simulated one (no model), and what the node says it serves in its server info."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from prefixgate.backends.server import NodeServer
from prefixgate.backends.tiny.vocab import OUTPUT_IDS
from tests.backends.conftest import StartNode
from tests.backends.test_smg_protocol import BS, LONG, TINY, collect, request


async def test_tiny_applies_logit_bias_and_returns_logprobs(nodes: StartNode) -> None:
    ns: NodeServer = await nodes("monolithic", engine=TINY, block_size=BS)
    forced = int(OUTPUT_IDS[9])
    async with grpc.aio.insecure_channel(ns.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        plain = (await collect(stub, request(LONG, max_new=5)))[-1].complete
        biased = (await collect(stub, request(LONG, max_new=5, logit_bias={str(forced): 100.0})))[-1].complete
        assert list(biased.output_ids) == [forced] * 5 and list(plain.output_ids) != [forced] * 5

        def with_logprobs(stream: bool) -> pb.GenerateRequest:
            req = request(LONG, max_new=6, stream=stream)
            req.return_logprob, req.top_logprobs_num = True, 2
            return req

        whole = (await collect(stub, with_logprobs(False)))[-1].complete
        lp = whole.output_logprobs
        assert list(lp.token_ids) == list(whole.output_ids)
        assert list(whole.output_ids)[:5] == list(plain.output_ids)  # asking for logprobs changes no token
        assert len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs)
        assert all(len(t.values) == len(t.token_ids) == 2 for t in lp.top_logprobs)
        assert [t.token_ids[0] for t in lp.top_logprobs] == list(whole.output_ids)  # greedy: the top one
        msgs = await collect(stub, with_logprobs(True))
        streamed = [v for m in msgs[:-1] for v in m.chunk.output_logprobs.token_logprobs]
        assert streamed == list(lp.token_logprobs)
        assert list(msgs[-1].complete.output_logprobs.token_logprobs) == list(lp.token_logprobs)
        info = MessageToDict((await stub.GetServerInfo(pb.GetServerInfoRequest())).scheduler_info)
        assert info["prefixgate_features"] == ["logit_bias", "logprobs", "response_format"]
    pre: NodeServer = await nodes("prefill", engine=TINY, block_size=BS, bootstrap_port=0)
    dec: NodeServer = await nodes("decode", engine=TINY, block_size=BS)
    assert pre.bootstrap is not None
    async with (
        grpc.aio.insecure_channel(pre.address) as pch,
        grpc.aio.insecure_channel(dec.address) as dch,
    ):
        p, d = pb_grpc.SglangSchedulerStub(pch), pb_grpc.SglangSchedulerStub(dch)
        for stream in (False, True):  # the decode leg reports them all, the first one handed over
            req = with_logprobs(stream)
            req.disaggregated_params.CopyFrom(
                pb.DisaggregatedParams(
                    bootstrap_host="127.0.0.1", bootstrap_port=pre.bootstrap.port, bootstrap_room=41 + stream
                )
            )
            both = await asyncio.gather(collect(p, req), collect(d, req))
            legs = both[1]  # the decode leg's
            if stream:
                got = [v for m in legs[:-1] for v in m.chunk.output_logprobs.token_logprobs]
                ids = [t for m in legs[:-1] for t in m.chunk.output_logprobs.token_ids]
            else:
                got = list(legs[-1].complete.output_logprobs.token_logprobs)
                ids = list(legs[-1].complete.output_logprobs.token_ids)
            assert got == list(lp.token_logprobs) and ids == list(whole.output_ids), stream
        for stub in (p, d):
            info = MessageToDict((await stub.GetServerInfo(pb.GetServerInfoRequest())).scheduler_info)
            assert info["prefixgate_features"] == ["logit_bias", "logprobs", "response_format"]


async def test_sim_refuses_logit_bias_and_logprobs(nodes: StartNode) -> None:
    ns: NodeServer = await nodes("monolithic", engine="sim", block_size=BS)
    async with grpc.aio.insecure_channel(ns.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request(LONG, max_new=2, logit_bias={"5": 10.0}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sim" in (e.value.details() or "")
        req = request(LONG, max_new=2)
        req.return_logprob = True
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprob" in (e.value.details() or "")
        info = MessageToDict((await stub.GetServerInfo(pb.GetServerInfoRequest())).scheduler_info)
        assert info["prefixgate_features"] == []
