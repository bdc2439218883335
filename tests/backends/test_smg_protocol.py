"""Our nodes as engines of the SMG gRPC protocol (``sglang.grpc.scheduler.SglangScheduler``),
driven with the ``smg-grpc-proto`` stubs as any client of that protocol would.

Contract: stream/non-stream semantics and cumulative counters, stops, cached tokens, abort, n,
tokenizer bundle, KV events, loads, and PD over the bootstrap room between two node processes.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import secrets
import sys
import time
import zipfile
from collections.abc import AsyncIterator
from io import BytesIO
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from tokenizers import Tokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.backends.server import NodeServer
from prefixgate.backends.smg_service import SGLANG_SERVICE
from prefixgate.v1 import node_pb2, node_pb2_grpc
from tests.backends.conftest import StartNode

ROOT = Path(__file__).resolve().parents[2]
TINY = "tiny:preset=small"
BS = 16
HF = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


def chat_ids(text: str) -> list[int]:
    rendered = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return list(HF.encode(rendered, add_special_tokens=False).ids)


LONG = chat_ids("Tell me everything about prefix caches, KV pages and the tokens they hold. " * 4)


def request(
    ids: list[int], *, max_new: int | None = 8, stream: bool = False, rid: str = "", **sampling: Any
) -> pb.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    params = pb.SamplingParams(
        top_p=1.0, top_k=-1, repetition_penalty=1.0, n=sampling.pop("n", 1), **sampling
    )
    if max_new is not None:
        params.max_new_tokens = max_new
    return pb.GenerateRequest(
        request_id=rid or secrets.token_hex(6),
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=params,
        stream=stream,
    )


async def collect(stub: pb_grpc.SglangSchedulerStub, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [m async for m in stub.Generate(req, timeout=30)]


@pytest.fixture
async def tiny(nodes: StartNode) -> AsyncIterator[tuple[NodeServer, pb_grpc.SglangSchedulerStub]]:
    ns = await nodes("monolithic", engine=TINY, block_size=BS)
    async with grpc.aio.insecure_channel(ns.address) as ch:
        yield ns, pb_grpc.SglangSchedulerStub(ch)


async def test_health_metadata_and_the_native_protocol_on_the_same_port(
    tiny: tuple[NodeServer, pb_grpc.SglangSchedulerStub],
) -> None:
    ns, stub = tiny
    async with grpc.aio.insecure_channel(ns.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", SGLANG_SERVICE):
            r = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        stats = await node_pb2_grpc.NodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=5)
        assert stats.engine == "tiny"
    t0 = time.monotonic()
    hc = await stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
    assert hc.healthy and time.monotonic() - t0 < 1.0

    info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.served_model_name == "prefixgate-tiny" and info.is_generation
    assert info.tokenizer_path == str(TOKENIZER_DIR) and info.model_path
    assert info.max_context_length > 0 and list(info.eos_token_ids) == [HF.token_to_id("<|im_end|>")]
    assert info.vocab_size == HF.get_vocab_size()
    defaults = json.loads(info.default_sampling_params_json)
    assert defaults["temperature"] == 1.0 and defaults["top_k"] == -1

    si = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    args = dict(si.server_args)
    assert args["disaggregation_mode"] == "null" and args["page_size"] == BS
    assert args["disaggregation_bootstrap_port"] == 0 and args["context_length"] > 0
    assert json.loads(args["kv_events_config"]) and si.server_type == "grpc"

    loads = await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
    assert len(loads.loads) == 1 and loads.dp_rank_count == 1
    load = loads.loads[0]
    assert load.dp_rank == 0 and load.num_running_reqs == 0 and load.num_waiting_reqs == 0
    assert 0 <= load.token_usage <= 1 and load.max_total_num_tokens > 0


async def test_bad_requests_are_invalid_argument(
    tiny: tuple[NodeServer, pb_grpc.SglangSchedulerStub],
) -> None:
    _, stub = tiny
    bad = [
        pb.GenerateRequest(request_id="x", sampling_params=pb.SamplingParams(max_new_tokens=4)),
        request([1, 2, 3], stop=["Hello"]),
        request([1, 2, 3], n=99),
    ]
    for req in bad:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


async def test_non_stream_and_stream_agree_and_follow_the_chunk_complete_rules(
    tiny: tuple[NodeServer, pb_grpc.SglangSchedulerStub],
) -> None:
    _, stub = tiny
    ids = chat_ids("Hello there, how are you?")
    whole = await collect(stub, request(ids, max_new=12))
    assert [m.WhichOneof("response") for m in whole] == ["complete"]
    c = whole[0].complete
    assert len(c.output_ids) == 12 and c.finish_reason == "length" and not c.HasField("matched_token_id")
    assert c.prompt_tokens == len(ids) and c.completion_tokens == 12 and c.index == 0

    msgs = await collect(stub, request(ids, max_new=12, stream=True))
    kinds = [m.WhichOneof("response") for m in msgs]
    assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"} and len(kinds) >= 3
    chunks = [m.chunk for m in msgs[:-1]]
    assert all(ch.token_ids for ch in chunks)
    assert [t for ch in chunks for t in ch.token_ids] == list(c.output_ids)  # new ids only
    counts = [ch.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 12  # cumulative
    assert all(ch.prompt_tokens == len(ids) for ch in chunks)
    done = msgs[-1].complete
    assert list(done.output_ids) == list(chunks[-1].token_ids)  # repeats the last chunk only
    assert done.completion_tokens == 12 and done.finish_reason == "length"
    assert HF.decode(list(c.output_ids))  # ids the shipped tokenizer decodes


@pytest.mark.parametrize("engine", ["sim", TINY])
async def test_a_streamed_chunk_holds_at_most_the_stream_interval(nodes: StartNode, engine: str) -> None:
    sizes = {}
    for interval in (1, 16):  # SGLang's default and ours (--stream-interval)
        ns = await nodes("monolithic", engine=engine, block_size=BS, stream_interval=interval)
        async with grpc.aio.insecure_channel(ns.address) as ch:
            msgs = await collect(pb_grpc.SglangSchedulerStub(ch), request(LONG, max_new=40, stream=True))
        chunks = [m.chunk for m in msgs if m.WhichOneof("response") == "chunk"]
        assert sum(len(c.token_ids) for c in chunks) == 40
        sizes[interval] = [len(c.token_ids) for c in chunks]
    assert set(sizes[1]) == {1}  # a chunk a token
    assert max(sizes[16]) <= 16 and max(sizes[16]) > 1  # decoded faster than sent: grouped


async def test_stop_token_ids_end_generation_with_matched_token(
    tiny: tuple[NodeServer, pb_grpc.SglangSchedulerStub],
) -> None:
    _, stub = tiny
    ids = chat_ids("Count to ten for me.")
    full = list((await collect(stub, request(ids, max_new=16)))[0].complete.output_ids)
    stop = full[5]
    cut = full.index(stop)
    for stream in (False, True):
        msgs = await collect(stub, request(ids, max_new=16, stream=stream, stop_token_ids=[stop]))
        done = msgs[-1].complete
        got = [t for m in msgs[:-1] for t in m.chunk.token_ids] if stream else list(done.output_ids)
        assert got == full[:cut] and done.finish_reason == "stop" and done.matched_token_id == stop
        assert done.completion_tokens == cut


async def test_repeated_prompt_reports_cached_tokens(
    tiny: tuple[NodeServer, pb_grpc.SglangSchedulerStub],
) -> None:
    _, stub = tiny
    first = (await collect(stub, request(LONG, max_new=2)))[-1].complete
    assert first.cached_tokens == 0
    longer = [*LONG, *chat_ids("And one more question.")]
    msgs = await collect(stub, request(longer, max_new=2, stream=True))
    assert all(m.chunk.cached_tokens == (len(LONG) // BS) * BS for m in msgs[:-1])
    assert msgs[-1].complete.cached_tokens == (len(LONG) // BS) * BS > 0


async def test_an_idle_warm_node_reports_its_cached_blocks_as_free(nodes: StartNode) -> None:
    """As SGLang: used = total - (free + evictable). Cached blocks nobody references are free to
    take, so a warm idle node is not full (a cache-aware router would otherwise balance load
    instead of following the cache); referenced and pinned blocks are in use."""
    # a small pool, so usage shows; real time (~10 ms a token) keeps the stream below running
    ns = await nodes("monolithic", engine="sim", block_size=BS, capacity_blocks=64, time_scale=1.0)
    prompt = [(i * 7 + 3) % 2000 + 3 for i in range(40 * BS)]  # 40 of 64 blocks
    async with grpc.aio.insecure_channel(ns.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        native = node_pb2_grpc.NodeStub(ch)
        first = (await collect(stub, request(prompt, max_new=2)))[-1].complete
        assert first.cached_tokens == 0
        idle = (await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)).loads[0]
        assert idle.num_running_reqs == 0 and idle.max_total_num_tokens == 64 * BS
        assert idle.token_usage == 0 and idle.num_used_tokens == 0 and idle.utilization == 0
        stats = await native.Stats(node_pb2.StatsRequest(), timeout=5)
        assert (stats.used_blocks, stats.evictable_blocks) == (40, 40)  # held, and all evictable
        again = (await collect(stub, request(prompt, max_new=2)))[-1].complete
        assert again.cached_tokens == 40 * BS  # the cache still held every block

        # A running request's blocks are in use, and so are pinned ones once it is gone.
        call = stub.Generate(request(prompt, max_new=2000, stream=True, temperature=1.0))
        await asyncio.wait_for(call.read(), 10)
        busy = (await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)).loads[0]
        assert busy.num_used_tokens == 40 * BS and busy.token_usage == 40 / 64
        call.cancel()
        for _ in range(100):
            if ns.node.snapshot().running_requests == 0:
                break
            await asyncio.sleep(0.02)
        hashes = ns.node.pool.snapshot()
        await native.Pin(node_pb2.PinRequest(block_hashes=[h for h, _ in hashes[:10]], pin_seconds=60))
        pinned = (await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)).loads[0]
        assert pinned.num_used_tokens == 10 * BS
        stats = await native.Stats(node_pb2.StatsRequest(), timeout=5)
        assert (stats.used_blocks, stats.evictable_blocks, stats.pinned_blocks) == (40, 30, 10)


async def test_n_choices_complete_once_per_index(
    tiny: tuple[NodeServer, pb_grpc.SglangSchedulerStub],
) -> None:
    _, stub = tiny
    for stream in (False, True):
        msgs = await collect(stub, request(LONG, max_new=4, n=2, stream=stream))
        completes = [m.complete for m in msgs if m.WhichOneof("response") == "complete"]
        assert sorted(c.index for c in completes) == [0, 1]
        assert all(c.completion_tokens == 4 for c in completes)


async def test_abort_ends_the_stream_and_unknown_ids_are_fine(nodes: StartNode) -> None:
    ns = await nodes("monolithic", engine="sim", time_scale=1.0)
    async with grpc.aio.insecure_channel(ns.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(request(LONG, max_new=2000, stream=True, rid="abort-me", temperature=1.0))
        first = await asyncio.wait_for(call.read(), 10)
        assert first.WhichOneof("response") == "chunk"
        ack = await stub.Abort(pb.AbortRequest(request_id="abort-me", reason="Stream dropped"), timeout=5)
        assert ack.success
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            while True:
                msg = await asyncio.wait_for(call.read(), 5)
                assert msg is not grpc.aio.EOF and msg.WhichOneof("response") == "chunk"
        assert e.value.code() == grpc.StatusCode.INTERNAL and "aborted" in (e.value.details() or "")
        assert time.monotonic() - t0 < 1.0
        ack = await stub.Abort(pb.AbortRequest(request_id="nobody", reason="x"), timeout=5)
        assert ack.success

        # cancelling the call alone also stops the work
        call = stub.Generate(request(LONG, max_new=2000, stream=True, temperature=1.0))
        await asyncio.wait_for(call.read(), 10)
        call.cancel()
        for _ in range(100):
            if ns.node.snapshot().running_requests == 0:
                break
            await asyncio.sleep(0.02)
        assert ns.node.snapshot().running_requests == 0


async def test_sim_engine_speaks_tokenizer_ids(nodes: StartNode) -> None:
    ns = await nodes("monolithic", engine="sim", block_size=BS)
    async with grpc.aio.insecure_channel(ns.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        done = (await collect(stub, request(LONG, max_new=20)))[-1].complete
    text = HF.decode(list(done.output_ids))
    assert text.startswith(" ") and all(len(w) == 3 for w in text.split())
    assert len(done.output_ids) == done.completion_tokens and done.completion_tokens <= 20


async def test_tokenizer_bundle(tiny: tuple[NodeServer, pb_grpc.SglangSchedulerStub], tmp_path: Path) -> None:
    _, stub = tiny
    parts = [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=10)]
    assert parts and all(len(p.data) <= 64 << 10 for p in parts)
    assert all(p.sha256 == "" for p in parts[:-1]) and len(parts[-1].sha256) == 64
    data = b"".join(p.data for p in parts)
    assert hashlib.sha256(data).hexdigest() == parts[-1].sha256
    with zipfile.ZipFile(BytesIO(data)) as zf:
        names = zf.namelist()
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(names)
        assert all("/" not in n and ".." not in n for n in names)
        zf.extractall(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.encode("Hello there").ids == HF.encode("Hello there").ids
    assert "<|im_start|>" in json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]


async def test_kv_events_carry_token_ids_and_chain(
    tiny: tuple[NodeServer, pb_grpc.SglangSchedulerStub],
) -> None:
    ns, stub = tiny
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=5)):
            pass
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE

    call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True))
    await asyncio.wait_for(call.initial_metadata(), 1.0)  # headers at once, before any batch
    first = await asyncio.wait_for(call.read(), 2)
    assert first.load.load_only and first.sequence_number == 0 and not first.events

    async def next_data() -> common_pb2.KvEventBatch:
        while True:
            b = await asyncio.wait_for(call.read(), 5)
            if b.events:
                return b

    await collect(stub, request(LONG, max_new=2))
    stored = await next_data()
    assert stored.sequence_number == 0 and not stored.load.load_only
    blocks = [b for ev in stored.events for b in ev.stored.blocks]
    assert len(blocks) == len(LONG) // BS
    assert [t for b in blocks for t in b.token_ids] == LONG[: len(blocks) * BS]
    assert all(b.block_size == BS == len(b.token_ids) for b in blocks)
    assert not stored.events[0].stored.HasField("parent_block_hash")  # the chain's root

    await collect(stub, request([*LONG, *LONG[:BS]], max_new=2))  # one more block on the chain
    more = await next_data()
    assert more.sequence_number == 1
    assert more.events[0].stored.parent_block_hash == blocks[-1].block_hash

    await stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=5)
    flushed = await next_data()
    assert flushed.sequence_number == 2
    kinds = {ev.WhichOneof("data") for ev in flushed.events}
    assert kinds <= {"removed", "cleared"} and kinds
    beat = await asyncio.wait_for(call.read(), 3)  # idle: heartbeats repeat the last number
    assert beat.load.load_only and beat.sequence_number == 2 and not beat.events
    call.cancel()
    assert ns.node.snapshot().used_blocks == 0


# -- PD over the bootstrap room, between two node processes -------------------------------


async def _spawn(*args: str) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    cmd = ["-m", "prefixgate.backends", "--port", "0", "--engine", TINY, "--block-size", str(BS), *args]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, json.loads(line)


@pytest.fixture(scope="module")
async def pd_pair() -> AsyncIterator[tuple[dict[str, Any], dict[str, Any]]]:
    procs: list[asyncio.subprocess.Process] = []
    try:
        p, prefill = await _spawn("--role", "prefill", "--bootstrap-port", "0", "--bootstrap-timeout", "3")
        procs.append(p)
        d, decode = await _spawn("--role", "decode", "--bootstrap-timeout", "3")
        procs.append(d)
        yield prefill, decode
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            await asyncio.wait_for(proc.wait(), 10)


def pd_request(
    ids: list[int], prefill: dict[str, Any], room: int, stream: bool, rid: str
) -> pb.GenerateRequest:
    req = request(ids, max_new=10, stream=stream, rid=rid)
    req.disaggregated_params.CopyFrom(
        pb.DisaggregatedParams(
            bootstrap_host="127.0.0.1", bootstrap_port=prefill["bootstrap_port"], bootstrap_room=room
        )
    )
    return req


async def test_pd_bootstrap_hands_kv_pages_to_the_decode_leg(
    pd_pair: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    prefill, decode = pd_pair
    assert prefill["bootstrap_port"] > 0 and "bootstrap_port" not in decode
    async with (
        grpc.aio.insecure_channel(prefill["address"]) as pch,
        grpc.aio.insecure_channel(decode["address"]) as dch,
    ):
        p, d = pb_grpc.SglangSchedulerStub(pch), pb_grpc.SglangSchedulerStub(dch)
        p_args = dict((await p.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)).server_args)
        assert p_args["disaggregation_mode"] == "prefill"
        assert p_args["disaggregation_bootstrap_port"] == prefill["bootstrap_port"]
        assert (
            dict((await d.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)).server_args)[
                "disaggregation_mode"
            ]
            == "decode"
        )
        # a router probes the bootstrap port with a bare connect and close: harmless
        _, w = await asyncio.open_connection("127.0.0.1", prefill["bootstrap_port"])
        w.close()

        # reference: the whole request on the decode node alone (same weights, greedy)
        ref = list((await collect(d, request(LONG, max_new=10)))[-1].complete.output_ids)
        for i, stream in enumerate((False, True, True)):
            rid, room = f"pd-{i}", secrets.randbelow(2**31 - 1)
            legs = await asyncio.gather(
                collect(p, pd_request(LONG, prefill, room, stream, rid)),
                collect(d, pd_request(LONG, prefill, room, stream, rid)),
            )
            pre, dec = legs
            assert [m.WhichOneof("response") for m in pre] == ["complete"]
            assert pre[0].complete.finish_reason == "length" and pre[0].request_id == rid
            assert pre[0].complete.prompt_tokens == len(LONG)
            out = (
                [t for m in dec[:-1] for t in m.chunk.token_ids]
                if stream
                else list(dec[-1].complete.output_ids)
            )
            assert out == ref  # the decode leg continues from the prefill's KV exactly
            done = dec[-1].complete
            assert done.completion_tokens == 10 and done.finish_reason == "length"
            cached = (len(LONG) // BS) * BS if i else 0  # the prefill node's prefix cache
            assert pre[0].complete.cached_tokens == cached and done.cached_tokens == cached


async def test_pd_decode_without_its_prefill_times_out(
    pd_pair: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    prefill, decode = pd_pair
    async with grpc.aio.insecure_channel(decode["address"]) as dch:
        d = pb_grpc.SglangSchedulerStub(dch)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(d, pd_request(LONG, prefill, 12345, False, "lonely"))
        assert e.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        assert time.monotonic() - t0 < 10


async def test_pd_refuses_kv_pages_of_another_model(nodes: StartNode) -> None:
    pre = await nodes("prefill", engine=TINY, block_size=BS, bootstrap_port=0, bootstrap_timeout_s=3)
    dec = await nodes("decode", engine=TINY + ",seed=7", block_size=BS, bootstrap_timeout_s=3)
    assert pre.bootstrap is not None
    info = {"bootstrap_port": pre.bootstrap.port}
    async with (
        grpc.aio.insecure_channel(pre.address) as pch,
        grpc.aio.insecure_channel(dec.address) as dch,
    ):
        p, d = pb_grpc.SglangSchedulerStub(pch), pb_grpc.SglangSchedulerStub(dch)
        legs = await asyncio.gather(
            collect(p, pd_request(LONG, info, 7, False, "mix")),
            collect(d, pd_request(LONG, info, 7, False, "mix")),
            return_exceptions=True,
        )
    for leg in legs:
        assert isinstance(leg, grpc.aio.AioRpcError) and leg.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "KV format mismatch" in (leg.details() or "")


def test_block_hash_chain_is_over_packed_u32_ids() -> None:
    """The node hashes SMG prompts as packed little-endian u32 blocks: the core needs no change."""
    from prefixgate.backends.smg_convert import chain_hashes, pack_ids

    packed = pack_ids(LONG)
    assert len(packed) == 4 * len(LONG) and packed[:4] == LONG[0].to_bytes(4, "little")
    hashes = chain_hashes(packed, BS, 1)
    assert len(hashes) == len(LONG) // BS and 0 not in hashes
    assert chain_hashes(packed[: 4 * BS], BS, 1) == hashes[:1]  # a key names its prefix


async def test_pd_prefill_leg_waiting_for_its_decode_can_be_aborted(nodes: StartNode) -> None:
    pre = await nodes("prefill", engine=TINY, block_size=BS, bootstrap_port=0, bootstrap_timeout_s=20)
    assert pre.bootstrap is not None
    async with grpc.aio.insecure_channel(pre.address) as pch:
        p = pb_grpc.SglangSchedulerStub(pch)
        leg = asyncio.ensure_future(
            collect(p, pd_request(LONG, {"bootstrap_port": pre.bootstrap.port}, 9, False, "w"))
        )
        await asyncio.sleep(0.3)
        assert not leg.done()
        t0 = time.monotonic()
        assert (await p.Abort(pb.AbortRequest(request_id="w"), timeout=5)).success
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(leg, 5)
        assert e.value.code() == grpc.StatusCode.INTERNAL and time.monotonic() - t0 < 1.0


async def test_n_choices_sample_apart(tiny: tuple[NodeServer, pb_grpc.SglangSchedulerStub]) -> None:
    _, stub = tiny
    msgs = await collect(stub, request(LONG, max_new=8, n=2, temperature=1.0))
    outs = {m.complete.index: list(m.complete.output_ids) for m in msgs}
    assert outs[0] != outs[1]
    again = await collect(stub, request(LONG, max_new=8, n=2, temperature=1.0))
    # no seed on this protocol: every request is sampled at random, as SGLang samples
    assert {m.complete.index: list(m.complete.output_ids) for m in again} != outs


async def test_pd_decode_waits_out_a_prefill_longer_than_the_bootstrap_timeout(nodes: StartNode) -> None:
    """The bootstrap timeout bounds finding the peer; a paired decode leg waits for the pages."""
    from prefixgate.backends.server import make_engine

    scale = 1.5 / make_engine("sim", "prefill").prefill_seconds(len(LONG), 0)  # a 1.5 s prefill
    pre = await nodes(
        "prefill", engine="sim", block_size=BS, time_scale=scale, bootstrap_port=0, bootstrap_timeout_s=0.5
    )
    dec = await nodes("decode", engine="sim", block_size=BS, bootstrap_timeout_s=0.5)
    assert pre.bootstrap is not None
    info = {"bootstrap_port": pre.bootstrap.port}
    async with (
        grpc.aio.insecure_channel(pre.address) as pch,
        grpc.aio.insecure_channel(dec.address) as dch,
    ):
        p, d = pb_grpc.SglangSchedulerStub(pch), pb_grpc.SglangSchedulerStub(dch)
        t0 = time.monotonic()
        pre_leg, dec_leg = await asyncio.gather(
            collect(p, pd_request(LONG, info, 11, False, "slow")),
            collect(d, pd_request(LONG, info, 11, False, "slow")),
        )
        assert time.monotonic() - t0 >= 1.4
    assert pre_leg[-1].complete.finish_reason == "length"
    assert dec_leg[-1].complete.completion_tokens > 0


async def test_a_late_subscriber_first_gets_what_the_pool_holds(
    tiny: tuple[NodeServer, pb_grpc.SglangSchedulerStub],
) -> None:
    _, stub = tiny
    await collect(stub, request(LONG, max_new=2))
    call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    held = await asyncio.wait_for(call.read(), 2)
    assert held.sequence_number == 0 and held.events
    blocks = [ev.stored for ev in held.events]
    assert [t for st in blocks for b in st.blocks for t in b.token_ids] == LONG[: len(blocks) * BS]
    assert len(blocks) == len(LONG) // BS and not blocks[0].HasField("parent_block_hash")
    assert all(st.parent_block_hash == prev.blocks[0].block_hash for prev, st in itertools.pairwise(blocks))
    await collect(stub, request([*LONG, *LONG[:BS]], max_new=2))
    while True:  # then the changes, numbered on
        b = await asyncio.wait_for(call.read(), 5)
        if b.events:
            break
    assert b.sequence_number == 1 and b.events[0].stored.parent_block_hash == blocks[-1].blocks[0].block_hash
    call.cancel()
