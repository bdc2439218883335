"""Engine doubles on real gRPC (loopback), for what our own nodes do not do: a scripted KV event
stream (gaps, DATA_LOSS, UNIMPLEMENTED), and a ``VllmEngine`` face that serves through one of
our nodes (its ``SglangScheduler``) and records the transfer parameters it is given. SGLang's
messages carry no seed: a seeded request is generated on the node itself, under that seed, as
vLLM honours ``SamplingParams.seed``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as spb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from prefixgate.backends.engine import Sampling
from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.backends.hftok import load as load_tokenizer
from prefixgate.backends.node import Node
from prefixgate.backends.smg_convert import chain_hashes, chain_root, pack_ids, token_map

Script = Callable[[int], list[Any]]  # subscription number -> batches, or a grpc.StatusCode to end with


def stored(block_hash: int, ids: list[int], parent: int | None = None) -> common_pb2.KvCacheEvent:
    s = common_pb2.KvBlocksStored(
        blocks=[common_pb2.KvBlock(block_hash=block_hash, token_ids=ids, block_size=len(ids))]
    )
    if parent is not None:
        s.parent_block_hash = parent
    return common_pb2.KvCacheEvent(stored=s)


def batch(seq: int, *events: common_pb2.KvCacheEvent, rank: int | None = None) -> common_pb2.KvEventBatch:
    b = common_pb2.KvEventBatch(sequence_number=seq, events=list(events))
    if rank is not None:
        b.dp_rank = rank
    return b


def long_prompt_batches(
    pages_n: int = 2_000,
) -> tuple[list[list[int]], common_pb2.KvEventBatch, common_pb2.KvEventBatch]:
    """A long prompt's pages of 16 tokens, stored as one batch holding all but the last page
    (a chain, each page's parent the one before) and a second batch with the last page."""
    pages = [[30_000 + (i * 16 + j) % 9_000 for j in range(16)] for i in range(pages_n)]
    events = [stored(1, pages[0])]
    events += [stored(i + 1, p, parent=i) for i, p in enumerate(pages[1:-1], start=1)]
    last = batch(1, stored(len(pages), pages[-1], parent=len(pages) - 1))
    return pages, batch(0, *events), last


class ScriptedSglang(spb_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    """Metadata of a 16-token-page SGLang engine, and KV events from ``script``."""

    def __init__(self, script: Script | None, loads: bool = True) -> None:
        self.script = script
        self.subscriptions = 0
        self.loads = loads

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        return spb.HealthCheckResponse(healthy=True)

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return spb.GetModelInfoResponse(model_path="double", tokenizer_path=str(TOKENIZER_DIR))

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        args = struct_pb2.Struct()
        args.update({"page_size": 16, "disaggregation_mode": "null"})
        return spb.GetServerInfoResponse(server_args=args)

    async def GetLoads(self, request: Any, context: Any) -> Any:
        if not self.loads:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no loads here")
        return spb.GetLoadsResponse(loads=[spb.SchedulerLoad(max_total_num_tokens=1600)])

    async def SubscribeKvEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if self.script is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "events are off")
        n = self.subscriptions
        self.subscriptions += 1
        await context.send_initial_metadata(())
        assert self.script is not None
        for item in self.script(n):
            if isinstance(item, grpc.StatusCode):
                await context.abort(item, "scripted end")
            yield item
        await asyncio.sleep(30)  # then silence, as an idle engine


@dataclass
class VllmOverOurNode(vpb_grpc.VllmEngineServicer):  # type: ignore[misc]
    """``VllmEngine`` answered by our node's ``SglangScheduler`` at ``target``; as a prefill
    (``kv_role`` kv_producer) it returns transfer parameters, as a decode it records them."""

    target: str
    kv_role: str = ""
    node: Node | None = None  # the node behind ``target``: seeded requests are generated on it
    params_seen: list[str] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = spb_grpc.SglangSchedulerStub(self.channel)

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        return vpb.HealthCheckResponse(healthy=True)

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        m = await self.stub.GetModelInfo(spb.GetModelInfoRequest())
        return vpb.GetModelInfoResponse(
            model_path=m.model_path, tokenizer_path=m.tokenizer_path, served_model_name=m.served_model_name
        )

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return vpb.GetServerInfoResponse(
            server_type="vllm-grpc",
            kv_connector="NixlConnector" if self.kv_role else "",
            kv_role=self.kv_role,
            kv_engine_id=f"engine-{self.target}",
            block_size=16,
            max_num_seqs=8,
        )

    async def GetLoads(self, request: Any, context: Any) -> Any:
        loads = await self.stub.GetLoads(spb.GetLoadsRequest())
        return vpb.GetLoadsResponse(
            loads=[vpb.SchedulerLoad(max_total_num_tokens=x.max_total_num_tokens) for x in loads.loads]
        )

    async def Abort(self, request: Any, context: Any) -> Any:
        self.aborted.extend(request.request_ids)
        for rid in request.request_ids:
            await self.stub.Abort(spb.AbortRequest(request_id=rid))
        return vpb.AbortResponse()

    async def _seeded(self, request: Any) -> AsyncIterator[Any]:
        """A whole seeded request on the node, under its seed (wire ids out, deltas counted;
        not streamed: one complete with every id)."""
        assert self.node is not None
        p = request.sampling_params
        tok = load_tokenizer()
        ids = list(request.tokenized.input_ids)
        tokens = pack_ids(ids)
        bs = self.node.block_size
        hashes = chain_hashes(tokens, bs, chain_root("vllm-double", bs, tok.path.name))
        wire = token_map(self.node.engine, tok)
        sampling = Sampling.normalized(p.max_tokens, p.temperature, p.top_p, p.seed, ())
        eos = self.node.engine.eos_token
        out: list[int] = []
        finish = "length"
        async for c in self.node.generate(tokens, hashes, sampling):
            new = [wire.wire(t) for t in c.token_ids if t != eos]
            out += new
            finish = c.finish_reason or finish
            if new and request.stream:
                yield vpb.GenerateResponse(
                    chunk=vpb.GenerateStreamChunk(
                        token_ids=new, prompt_tokens=len(ids), completion_tokens=len(new)
                    )
                )
        done = vpb.GenerateComplete(
            output_ids=out[-1:] if request.stream else out,
            finish_reason=finish,
            prompt_tokens=len(ids),
            completion_tokens=len(out),
        )
        yield vpb.GenerateResponse(complete=done)

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.requests.append(request)
        if request.HasField("kv_transfer_params_json"):
            self.params_seen.append(request.kv_transfer_params_json)
        p = request.sampling_params
        if p.HasField("seed") and self.node is not None:
            async for m in self._seeded(request):
                yield m
            return
        sp = spb.SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=-1, stop_token_ids=list(p.stop_token_ids)
        )
        if p.HasField("max_tokens"):
            sp.max_new_tokens = p.max_tokens
        for token_id, bias in p.logit_bias.items():  # vLLM's int32 keys, SGLang's strings
            sp.logit_bias[str(token_id)] = bias
        req = spb.GenerateRequest(
            request_id=request.request_id,
            tokenized=spb.TokenizedInput(input_ids=list(request.tokenized.input_ids)),
            sampling_params=sp,
            stream=request.stream,
            logprob_start_len=-1,
        )
        if p.HasField("logprobs"):  # vLLM: that many alternatives a token (the chosen one's too)
            req.return_logprob, req.top_logprobs_num = True, p.logprobs
        last = 0
        async for m in self.stub.Generate(req):
            if m.HasField("chunk"):
                c = m.chunk
                yield vpb.GenerateResponse(
                    chunk=vpb.GenerateStreamChunk(
                        token_ids=list(c.token_ids),
                        prompt_tokens=c.prompt_tokens,
                        completion_tokens=c.completion_tokens - last,
                        cached_tokens=c.cached_tokens,
                        output_logprobs=_vllm_logprobs(c) if c.HasField("output_logprobs") else None,
                    )
                )
                last = c.completion_tokens
                continue
            c = m.complete
            done = vpb.GenerateComplete(
                output_ids=list(c.output_ids),
                finish_reason=c.finish_reason,
                prompt_tokens=c.prompt_tokens,
                completion_tokens=c.completion_tokens,
                cached_tokens=c.cached_tokens,
                output_logprobs=_vllm_logprobs(c) if c.HasField("output_logprobs") else None,
            )
            if self.kv_role == "kv_producer" and request.HasField("kv_transfer_params_json"):
                done.kv_transfer_params_json = json.dumps(
                    {
                        "do_remote_prefill": True,
                        "do_remote_decode": False,
                        "remote_block_ids": [1, 2],
                        "remote_engine_id": f"engine-{self.target}",
                        "remote_host": "127.0.0.1",
                        "remote_port": 1,
                    }
                )
            yield vpb.GenerateResponse(complete=done)


def _vllm_logprobs(msg: Any) -> Any:
    """SGLang's ``output_logprobs`` as vLLM's (the same fields)."""
    lp = msg.output_logprobs
    return vpb.OutputLogProbs(
        token_logprobs=list(lp.token_logprobs),
        token_ids=list(lp.token_ids),
        top_logprobs=[
            vpb.TopLogProbs(values=list(t.values), token_ids=list(t.token_ids)) for t in lp.top_logprobs
        ],
    )


async def serve(add: Callable[[grpc.aio.Server], None]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def add_sglang(servicer: Any) -> Callable[[grpc.aio.Server], None]:
    return lambda s: spb_grpc.add_SglangSchedulerServicer_to_server(servicer, s)


def add_vllm(servicer: Any) -> Callable[[grpc.aio.Server], None]:
    return lambda s: vpb_grpc.add_VllmEngineServicer_to_server(servicer, s)
