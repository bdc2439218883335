"""Real node servers on loopback: the split path, caching, events, failures and cleanup."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixgate.backends.kvpages import checksum
from prefixgate.backends.profiles import S5000
from prefixgate.backends.server import NodeServer
from prefixgate.v1 import node_pb2

Prompt = Callable[..., tuple[bytes, list[int]]]


async def drain(call: AsyncIterator[node_pb2.TokenChunk]) -> tuple[str, list[int], node_pb2.TokenChunk]:
    text, ids = "", list[int]()
    last = node_pb2.TokenChunk()
    async for c in call:
        text += c.text
        ids.extend(c.token_ids)
        last = c
    return text, ids, last


async def until(cond: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def stage(err: grpc.aio.AioRpcError) -> str:
    return str(dict(err.trailing_metadata() or ()).get("x-prefixgate-stage", ""))


async def split_run(
    stub: Any, p: NodeServer, d: NodeServer, tokens: bytes, hashes: list[int], sp: node_pb2.SamplingParams
) -> tuple[str, list[int], node_pb2.TokenChunk, node_pb2.PrefillResponse]:
    r = await stub(p.address).Prefill(
        node_pb2.PrefillRequest(
            request_id="split", tokens=tokens, block_hashes=hashes, sampling=sp, decode_address=d.address
        )
    )
    text, ids, last = await drain(
        stub(d.address).Decode(node_pb2.DecodeRequest(request_id="split", kv_handle=r.kv_handle, sampling=sp))
    )
    return r.first_text + text, [r.first_token, *ids], last, r


async def mono_run(
    stub: Any, m: NodeServer, tokens: bytes, hashes: list[int], sp: node_pb2.SamplingParams
) -> tuple[str, list[int], node_pb2.TokenChunk]:
    return await drain(
        stub(m.address).Generate(
            node_pb2.GenerateRequest(request_id="mono", tokens=tokens, block_hashes=hashes, sampling=sp)
        )
    )


SAMPLINGS = [
    {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9},  # under the shortest natural length (16)
    {"max_tokens": 500, "temperature": 0.8, "seed": 7, "has_seed": True},  # over the longest (255)
    {"max_tokens": 30, "temperature": 0.0},
    {"max_tokens": 1, "temperature": 1.0},
]


@pytest.mark.parametrize("params", SAMPLINGS)
async def test_split_path_matches_monolithic(
    nodes: Any, stub: Any, prompt: Prompt, params: dict[str, Any]
) -> None:
    p, d, m = await nodes("prefill"), await nodes("decode"), await nodes("monolithic")
    tokens, hashes = prompt(1000)  # 15 full blocks + 40 tokens
    sp = node_pb2.SamplingParams(**params)
    s_text, s_ids, s_last, r = await split_run(stub, p, d, tokens, hashes, sp)
    m_text, m_ids, m_last = await mono_run(stub, m, tokens, hashes, sp)
    assert s_text == m_text and s_ids == m_ids and len(s_text) > 0
    assert s_last.finish_reason == m_last.finish_reason
    assert r.prompt_tokens == 1000 and r.cached_tokens == 0
    if params["max_tokens"] == 1:  # Decode still works: it only closes the stream with usage
        assert r.finished and r.finish_reason == "length" and r.kv_handle
        assert s_last.finish_reason == "length" and s_last.completion_tokens == 1
    assert m_last.completion_tokens == s_last.completion_tokens == len(m_ids)
    assert m_last.prompt_tokens == s_last.prompt_tokens == 1000
    if params["max_tokens"] == 1:
        assert len(m_ids) == 1 and m_last.finish_reason == "length"
    elif params["max_tokens"] == 500:
        assert m_last.finish_reason == "stop" and len(m_ids) < 500  # ended by itself
    else:
        assert m_last.finish_reason == "length" and len(m_ids) == params["max_tokens"]
    # Real bytes moved: 320 bytes a token (Llama-70B-class fp8 KV x 1/512).
    assert r.transfer_bytes == 1000 * 320 and r.transfer_seconds > 0
    stats = await stub(d.address).Stats(node_pb2.StatsRequest())
    assert stats.used_blocks == 15  # the decode node holds the KV too


async def test_stop_strings_agree_on_both_paths(nodes: Any, stub: Any, prompt: Prompt) -> None:
    p, d, m = await nodes("prefill"), await nodes("decode"), await nodes("monolithic")
    tokens, hashes = prompt(300, salt=3)
    base = node_pb2.SamplingParams(max_tokens=40, temperature=0.9, seed=11, has_seed=True)
    full, _, _ = await mono_run(stub, m, tokens, hashes, base)
    stop = full[13:20]  # spans a token boundary
    sp = node_pb2.SamplingParams(max_tokens=40, temperature=0.9, seed=11, has_seed=True, stop=[stop, "zzz"])
    s_text, _, s_last, _ = await split_run(stub, p, d, tokens, hashes, sp)
    m_text, _, m_last = await mono_run(stub, m, tokens, hashes, sp)
    assert s_text == m_text == full[: full.index(stop)]
    assert s_last.finish_reason == m_last.finish_reason == "stop"
    # A stop string in the first token: prefill finishes the request; Decode only closes it.
    sp = node_pb2.SamplingParams(max_tokens=40, temperature=0.9, seed=11, has_seed=True, stop=[full[1:4]])
    s_text, _, s_last, r = await split_run(stub, p, d, tokens, hashes, sp)
    m_text, _, m_last = await mono_run(stub, m, tokens, hashes, sp)
    assert r.finished and r.finish_reason == "stop" and r.first_text == " "
    assert s_text == m_text == " " and s_last.finish_reason == m_last.finish_reason == "stop"
    assert s_last.completion_tokens == m_last.completion_tokens == 1


async def test_second_prefill_reuses_cached_prefix(nodes: Any, stub: Any, prompt: Prompt) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    tokens, hashes = prompt(1000)
    sp = node_pb2.SamplingParams(max_tokens=5, temperature=1.0)
    _, _, last1, r1 = await split_run(stub, p, d, tokens, hashes, sp)
    _, _, last2, r2 = await split_run(stub, p, d, tokens, hashes, sp)
    assert (r1.cached_tokens, r2.cached_tokens) == (0, 960)
    assert (last1.cached_tokens, last2.cached_tokens) == (0, 960)  # Decode reports the prefill's reuse
    # A longer prompt sharing the first 10 blocks reuses exactly those.
    longer, lh = prompt(2000, salt=9, prefix=tokens[: 640 * 4])
    r3 = await stub(p.address).Prefill(node_pb2.PrefillRequest(tokens=longer, block_hashes=lh, sampling=sp))
    assert r3.cached_tokens == 640 and r3.kv_handle == ""
    # Monolithic Generate reports what that node reused.
    m = await nodes("monolithic")
    _, _, g1 = await mono_run(stub, m, tokens, hashes, sp)
    _, _, g2 = await mono_run(stub, m, tokens, hashes, sp)
    assert (g1.cached_tokens, g2.cached_tokens) == (0, 960)
    st = await stub(p.address).Stats(node_pb2.StatsRequest())
    assert st.prompt_tokens == 4000 and st.prefix_hit_tokens == 960 + 640


async def test_kv_format_mismatch_is_refused_clearly(nodes: Any, stub: Any, prompt: Prompt) -> None:
    p = await nodes("prefill")
    other_block = await nodes("decode", block_size=32)
    other_scale = await nodes("decode", kv_scale=1 / 256)
    tokens, hashes = prompt(200)
    for d, field, ours, theirs in (
        (other_block, "block_size", 64, 32),
        (other_scale, "bytes_per_token", 320, 640),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub(p.address).Prefill(
                node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes, decode_address=d.address)
            )
        err = ei.value
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "KV format mismatch" in (err.details() or "")
        assert f"{field}: sender {ours} != receiver {theirs}" in (err.details() or "")
        assert d.address in (err.details() or "") and stage(err) == "transfer"
        assert d.node.pool.counts().used == 0
    assert p.node.pool.counts().referenced == 0


async def test_kv_events_snapshot_stored_removed(nodes: Any, stub: Any, prompt: Prompt) -> None:
    n = await nodes("prefill")
    s = stub(n.address)
    tokens, hashes = prompt(640)  # 10 blocks
    more, more_h = prompt(896, salt=5, prefix=tokens)  # the same 10 + 4 more
    assert more_h[:10] == hashes
    events = s.KVEvents(node_pb2.KVEventsRequest(since_seq=0))
    it = events.__aiter__()

    async def nxt() -> node_pb2.KVEvent:
        return await asyncio.wait_for(it.__anext__(), 1.0)  # events go out promptly

    snap = await nxt()
    assert snap.kind == node_pb2.KVEvent.SNAPSHOT and snap.seq == 0 and not snap.block_hashes
    iid = snap.instance_id
    await s.Prefill(node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes, skip_first_token=True))
    e1 = await nxt()
    assert (e1.seq, e1.kind, e1.parent_hash, list(e1.block_hashes)) == (1, node_pb2.KVEvent.STORED, 0, hashes)
    await s.Prefill(node_pb2.PrefillRequest(tokens=more, block_hashes=more_h))
    e2 = await nxt()
    assert (e2.seq, e2.parent_hash, list(e2.block_hashes)) == (2, hashes[-1], more_h[10:])
    ev = await s.Evict(node_pb2.EvictRequest(block_hashes=[hashes[6]]))
    assert set(ev.evicted) == set(more_h[6:])  # the block and every descendant
    e3 = await nxt()
    assert e3.seq == 3 and e3.kind == node_pb2.KVEvent.REMOVED and set(e3.block_hashes) == set(more_h[6:])
    assert {e.instance_id for e in (e1, e2, e3)} == {iid}
    events.cancel()
    # Resume after seq 2: just the missed event. From 0: a snapshot with parents first.
    resumed = s.KVEvents(node_pb2.KVEventsRequest(since_seq=2))
    r = await asyncio.wait_for(resumed.__aiter__().__anext__(), 1.0)
    assert r.seq == 3 and r.kind == node_pb2.KVEvent.REMOVED
    resumed.cancel()
    again = s.KVEvents(node_pb2.KVEventsRequest(since_seq=0))
    snap2 = await asyncio.wait_for(again.__aiter__().__anext__(), 1.0)
    assert snap2.seq == 3 and list(snap2.block_hashes) == hashes[:6]
    assert list(snap2.parent_hashes) == [0, *hashes[:5]]
    again.cancel()
    st = await s.Stats(node_pb2.StatsRequest())
    assert st.kv_event_seq == 3 and st.instance_id == iid


async def test_eviction_events_reach_followers_promptly(nodes: Any, stub: Any, prompt: Prompt) -> None:
    n = await nodes("prefill", capacity_blocks=20)
    s = stub(n.address)
    events = s.KVEvents(node_pb2.KVEventsRequest())
    it = events.__aiter__()
    await asyncio.wait_for(it.__anext__(), 1.0)
    for salt in range(3):  # 3 x 10 blocks into 20: the oldest chain is evicted, leaves first
        tokens, hashes = prompt(640, salt=salt)
        await s.Prefill(node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes))
    kinds = []
    for _ in range(4):
        e = await asyncio.wait_for(it.__anext__(), 1.0)
        kinds.append(e.kind)
        if e.kind == node_pb2.KVEvent.REMOVED:
            first_chain = prompt(640, salt=0)[1]
            assert list(e.block_hashes) == first_chain[::-1]
    assert kinds == [node_pb2.KVEvent.STORED] * 2 + [node_pb2.KVEvent.REMOVED, node_pb2.KVEvent.STORED]
    events.cancel()


async def test_pin_and_pool_exhaustion(nodes: Any, stub: Any, prompt: Prompt) -> None:
    n = await nodes("prefill", capacity_blocks=4)
    s = stub(n.address)
    big, big_h = prompt(5 * 64)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await s.Prefill(node_pb2.PrefillRequest(tokens=big, block_hashes=big_h))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and stage(ei.value) == "pool"
    tokens, hashes = prompt(4 * 64)
    await s.Prefill(node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes, pin_seconds=60))
    other, other_h = prompt(2 * 64, salt=1)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await s.Prefill(node_pb2.PrefillRequest(tokens=other, block_hashes=other_h))
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "exhausted" in (ei.value.details() or "")
    st = await s.Stats(node_pb2.StatsRequest())
    assert (st.used_blocks, st.pinned_blocks) == (4, 4)
    n.node.pool.check()
    assert n.node.pool.counts().referenced == 0 and n.node.pool.reserved == 0
    pin = await s.Pin(node_pb2.PinRequest(block_hashes=[*hashes[2:], 12345], pin_seconds=0))
    assert (pin.pinned, pin.missing) == (2, 1)
    r = await s.Prefill(node_pb2.PrefillRequest(tokens=other, block_hashes=other_h))
    assert r.prompt_tokens == 128
    assert n.node.pool.leading(hashes) == 2  # the unpinned tail went, leaves first


async def test_request_errors(nodes: Any, stub: Any, prompt: Prompt) -> None:
    n = await nodes("decode")
    s = stub(n.address)
    tokens, hashes = prompt(200)
    cases: list[tuple[Any, grpc.StatusCode, str]] = [
        (
            node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes[:-1]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "3 full",
        ),
        (
            node_pb2.PrefillRequest(tokens=tokens[:-1], block_hashes=hashes),
            grpc.StatusCode.INVALID_ARGUMENT,
            "uint32",
        ),
        (node_pb2.PrefillRequest(), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ]
    for req, code, text in cases:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await s.Prefill(req)
        assert ei.value.code() == code and text in (ei.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await drain(s.Decode(node_pb2.DecodeRequest(kv_handle="nope")))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await drain(s.Generate(node_pb2.GenerateRequest(tokens=tokens, block_hashes=[1])))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_kv_handle_single_use_and_ttl(nodes: Any, stub: Any, prompt: Prompt) -> None:
    p, d = await nodes("prefill"), await nodes("decode", handle_ttl_s=0.3)
    tokens, hashes = prompt(300)
    sp = node_pb2.SamplingParams(max_tokens=4, temperature=1.0)
    req = node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes, sampling=sp, decode_address=d.address)
    r = await stub(p.address).Prefill(req)
    await drain(stub(d.address).Decode(node_pb2.DecodeRequest(kv_handle=r.kv_handle)))
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await drain(stub(d.address).Decode(node_pb2.DecodeRequest(kv_handle=r.kv_handle)))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    r = await stub(p.address).Prefill(req)
    assert d.node.pool.counts().referenced == 4  # held for the pending handle
    await until(lambda: asyncio.sleep(0, len(d.node.handles) == 0))
    assert d.node.pool.counts().referenced == 0
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await drain(stub(d.address).Decode(node_pb2.DecodeRequest(kv_handle=r.kv_handle)))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND


async def test_cancelled_generate_frees_blocks(nodes: Any, stub: Any, prompt: Prompt) -> None:
    m = await nodes("monolithic", time_scale=1.0)  # ~10 ms between tokens
    tokens, hashes = prompt(700)
    call = stub(m.address).Generate(
        node_pb2.GenerateRequest(
            tokens=tokens,
            block_hashes=hashes,
            sampling=node_pb2.SamplingParams(max_tokens=1000, temperature=1),
        )
    )
    it = call.__aiter__()
    await asyncio.wait_for(it.__anext__(), 5)
    assert m.node.pool.counts().referenced == 10
    call.cancel()
    await until(lambda: asyncio.sleep(0, m.node.pool.counts().referenced == 0))
    st = await stub(m.address).Stats(node_pb2.StatsRequest())
    assert st.running_requests == 0 and st.used_blocks == 10  # still cached, no longer held
    m.node.pool.check()


async def test_cancelled_prefill_and_decode_free_everything(nodes: Any, stub: Any, prompt: Prompt) -> None:
    # 64K tokens at time scale 1: ~0.7 s of simulated S5000 prefill.
    p = await nodes("prefill", time_scale=1.0, capacity_blocks=2048)
    s = stub(p.address)
    tokens, hashes = prompt(65_536)
    call = s.Prefill(node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes))
    await until(lambda: asyncio.sleep(0, p.node.pool.reserved > 0))
    call.cancel()
    await until(lambda: asyncio.sleep(0, p.node.pool.reserved == 0 and not p.node.prefills.running))
    assert len(p.node.pool) == 0 and p.node.pool.counts().referenced == 0
    # Decode cancelled mid-stream: the handle is used up and its blocks released.
    d = await nodes("decode", time_scale=1.0)
    short, sh = prompt(300)
    r = await s.Prefill(node_pb2.PrefillRequest(tokens=short, block_hashes=sh, decode_address=d.address))
    dec = stub(d.address).Decode(
        node_pb2.DecodeRequest(kv_handle=r.kv_handle, sampling=node_pb2.SamplingParams(max_tokens=1000))
    )
    await asyncio.wait_for(dec.__aiter__().__anext__(), 5)
    dec.cancel()
    await until(lambda: asyncio.sleep(0, d.node.pool.counts().referenced == 0 and not d.node.streams.running))
    assert not d.node.handles


async def test_queue_full_is_resource_exhausted(nodes: Any, stub: Any, prompt: Prompt) -> None:
    # 4096 tokens at time scale 50: ~1.5 s each, one at a time, one waiting.
    n = await nodes("prefill", time_scale=50.0, max_concurrency=1, max_queue=1)
    s = stub(n.address)
    calls = []
    for salt in range(2):
        tokens, hashes = prompt(4096, salt=salt)
        calls.append(s.Prefill(node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes)))
        want = salt

        async def admitted(want: int = want) -> bool:
            st = await s.Stats(node_pb2.StatsRequest())
            return bool(st.running_requests == 1 and st.queued_requests == want)

        await until(admitted)
    st = await s.Stats(node_pb2.StatsRequest())
    assert st.queued_tokens > 4096  # the waiting prompt plus what the running one has left
    tokens, hashes = prompt(4096, salt=2)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await s.Prefill(node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes))
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stage(ei.value) == "queue" and "queue full" in (ei.value.details() or "")
    for c in calls:
        c.cancel()
    await until(lambda: asyncio.sleep(0, not n.node.prefills.running and not n.node.prefills.waiting))
    assert n.node.pool.reserved == 0 and n.node.pool.counts().referenced == 0


async def test_stats_health_and_reported_profile(nodes: Any, stub: Any) -> None:
    n = await nodes("prefill", time_scale=0.05, node_id="prefill-1", capacity_blocks=777, max_queue=9)
    st = await stub(n.address).Stats(node_pb2.StatsRequest())
    assert (st.node_id, st.role, st.engine, st.capacity_blocks, st.max_queue) == (
        "prefill-1",
        "prefill",
        "sim",
        777,
        9,
    )
    assert st.kv_format.block_size == 64 and st.kv_format.bytes_per_token == 320
    assert st.kv_format.dtype == "fp8_e4m3" and st.kv_format.model_fingerprint.startswith("sim:")
    assert st.profile.name == "s5000" and st.profile.time_scale == pytest.approx(0.05)
    assert st.profile.prefill_tokens_per_s == pytest.approx(S5000.prefill_tokens_per_s / 0.05)
    assert st.profile.attention_coeff_s == pytest.approx(S5000.attention_coeff_s * 0.05)
    assert st.profile.transfer_bytes_per_s > 0 and len(st.instance_id) == 16
    async with grpc.aio.insecure_channel(n.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "prefixgate.v1.Node"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("n_tokens", [1, 63, 64, 128, 129])
async def test_prompt_lengths_around_block_boundaries(
    nodes: Any, stub: Any, prompt: Prompt, n_tokens: int
) -> None:
    p, d, m = await nodes("prefill"), await nodes("decode"), await nodes("monolithic")
    tokens, hashes = prompt(n_tokens, salt=n_tokens)
    sp = node_pb2.SamplingParams(max_tokens=8, temperature=0.5, seed=1, has_seed=True)
    s_text, s_ids, _, r = await split_run(stub, p, d, tokens, hashes, sp)
    m_text, m_ids, last = await mono_run(stub, m, tokens, hashes, sp)
    assert (s_text, s_ids) == (m_text, m_ids) and len(m_ids) == 8
    assert r.transfer_bytes == n_tokens * 320 and last.prompt_tokens == n_tokens
    assert d.node.pool.counts().used == n_tokens // 64


async def test_transfer_stream_is_verified(nodes: Any, stub: Any, prompt: Prompt) -> None:
    d = await nodes("decode")
    s = stub(d.address)
    tokens, hashes = prompt(100)  # one full block + 36 tokens
    fmt = (await s.Stats(node_pb2.StatsRequest())).kv_format
    header = node_pb2.KVTransferHeader(kv_handle="h1", format=fmt, tokens=tokens, num_pages=2, first_token=1)
    good = [
        node_pb2.KVPage(index=0, block_hash=hashes[0], num_tokens=64, data=b"a" * 64 * 320),
        node_pb2.KVPage(index=1, block_hash=0, num_tokens=36, data=b"b" * 36 * 320),
    ]
    for page in good:
        page.checksum = checksum(page.data)

    async def send(*chunks: node_pb2.KVTransferChunk) -> node_pb2.KVTransferAck:
        async def gen() -> AsyncIterator[node_pb2.KVTransferChunk]:
            for c in chunks:
                yield c

        ack: node_pb2.KVTransferAck = await s.TransferKV(gen())
        return ack

    def pages(*ps: node_pb2.KVPage) -> list[node_pb2.KVTransferChunk]:
        return [node_pb2.KVTransferChunk(page=p) for p in ps]

    bad_sum = node_pb2.KVPage()
    bad_sum.CopyFrom(good[1])
    bad_sum.checksum ^= 1
    short = node_pb2.KVPage()
    short.CopyFrom(good[1])
    short.data = short.data[:-1]
    short.checksum = checksum(short.data)
    hdr = node_pb2.KVTransferChunk(header=header)
    cases = [
        ((*pages(good[0]),), grpc.StatusCode.INVALID_ARGUMENT, "starts with a KVTransferHeader"),
        ((hdr, *pages(good[0], bad_sum)), grpc.StatusCode.DATA_LOSS, "checksum"),
        ((hdr, *pages(good[0], short)), grpc.StatusCode.INVALID_ARGUMENT, "bytes, expected"),
        ((hdr, *pages(good[0])), grpc.StatusCode.INVALID_ARGUMENT, "1 of 2"),
        ((hdr, *pages(good[1], good[0])), grpc.StatusCode.INVALID_ARGUMENT, "page 0"),
        ((hdr, *pages(*good), hdr), grpc.StatusCode.INVALID_ARGUMENT, "only the first"),
    ]
    for chunks, code, text in cases:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await send(*chunks)
        assert ei.value.code() == code and text in (ei.value.details() or ""), ei.value.details()
    assert d.node.pool.counts().used == 0 and not d.node.handles
    ack = await send(hdr, *pages(*good))
    assert (ack.kv_handle, ack.pages, ack.bytes, ack.reused_pages) == ("h1", 2, 100 * 320, 0)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await send(hdr, *pages(*good))
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
    header.kv_handle = "h2"
    ack = await send(node_pb2.KVTransferChunk(header=header), *pages(*good))
    assert ack.reused_pages == 1
    text, _, last = await drain(s.Decode(node_pb2.DecodeRequest(kv_handle="h2")))
    assert text and last.finish_reason and last.prompt_tokens == 100


async def test_reported_transfer_rate_is_measured(nodes: Any, stub: Any, prompt: Prompt) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    tokens, hashes = prompt(4096)  # 1.3 MB of pages: enough to measure a rate
    r = await stub(p.address).Prefill(
        node_pb2.PrefillRequest(tokens=tokens, block_hashes=hashes, decode_address=d.address)
    )
    st = await stub(p.address).Stats(node_pb2.StatsRequest())
    assert st.profile.transfer_bytes_per_s == pytest.approx(r.transfer_bytes / r.transfer_seconds, rel=0.05)


async def test_every_chunk_carries_usage_so_far(nodes: Any, stub: Any, prompt: Prompt) -> None:
    m = await nodes("monolithic")
    tokens, hashes = prompt(300)
    await mono_run(stub, m, tokens, hashes, node_pb2.SamplingParams(max_tokens=3))
    chunks = [
        c
        async for c in stub(m.address).Generate(
            node_pb2.GenerateRequest(
                tokens=tokens, block_hashes=hashes, sampling=node_pb2.SamplingParams(max_tokens=12)
            )
        )
    ]
    assert chunks[0].prefill_seconds >= 0 and len(chunks[0].token_ids) == 1
    assert all(c.prompt_tokens == 300 and c.cached_tokens == 256 for c in chunks)
    counts = [c.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 12
    assert [bool(c.finish_reason) for c in chunks] == [False] * (len(chunks) - 1) + [True]
