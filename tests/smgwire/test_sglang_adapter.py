"""The gateway's SGLang adapter (``grpc://``) against our own nodes serving ``SglangScheduler`` on
loopback: detection and status, generation (text equal to the node's own greedy output, decoded
with the engine's tokenizer), stops, PD through the bootstrap room, abort on close, and the index
from ``SubscribeKvEvents``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from prefixgate.backends.server import NodeServer
from prefixgate.backends.smg_service import SglangSchedulerService
from prefixgate.cachetier.hashing import block_hashes
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.cluster.events import EventSync
from prefixgate.gateway.cluster.nodes import NodePool
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.nodeclient import NodeFailure, Prompt, TokenStream
from prefixgate.gateway.nodeclient.handoff import BootstrapStream
from prefixgate.gateway.nodeclient.smg_common import SmgNodeClient, SmgOptions
from prefixgate.gateway.vocab import FailureKind, Stage
from prefixgate.openai.schema import Sampling
from tests.smgwire import doubles
from tests.smgwire.conftest import BS, HF, MODEL, Client, StartNode, chat_ids, root_of

LONG = chat_ids("Tell me everything about prefix caches, KV pages and the tokens they hold. " * 4)


def prompt(
    ids: list[int], max_tokens: int = 12, stop: tuple[str, ...] = (), rid: str = "r", stream: bool = True
) -> Prompt:
    tokens = pack_ids(ids)
    root = root_of(MODEL, "", "")
    assert root is not None
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0, stop=list(stop), stream=stream)
    return Prompt(rid, tokens, block_hashes(tokens, BS, root), sampling)


async def direct_ids(ns: NodeServer, ids: list[int], max_new: int) -> list[int]:
    req = pb.GenerateRequest(
        request_id=f"direct-{time.monotonic_ns()}",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new),
    )
    async with grpc.aio.insecure_channel(ns.address) as ch:
        out = [m async for m in pb_grpc.SglangSchedulerStub(ch).Generate(req, timeout=30)]
    return list(out[-1].complete.output_ids)


async def collect(stream: TokenStream) -> tuple[str, str, int]:
    text, finish, completion = "", "", 0
    async with asyncio.timeout(30):
        async for d in stream:
            text += d.text
            completion = d.completion_tokens or completion
            if d.finish_reason:
                finish = d.finish_reason
                break
    await stream.aclose()
    return text, finish, completion


@pytest.fixture
def aborts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    """Every Abort our nodes receive: (request id, when)."""
    seen: list[tuple[str, float]] = []
    original = SglangSchedulerService.Abort

    async def recording(self: SglangSchedulerService, request: Any, context: Any) -> Any:
        seen.append((request.request_id, time.monotonic()))
        return await original(self, request, context)

    monkeypatch.setattr(SglangSchedulerService, "Abort", recording)
    return seen


async def test_runtime_detected_and_status_from_server_info_and_loads(
    nodes: StartNode, client: Client
) -> None:
    ns = await nodes("prefill")
    c = client(ns)
    st = await c.status(timeout=5)
    assert c.runtime is not None and c.runtime.name == "sglang"
    assert st.engine == "sglang" and st.role == "prefill"
    assert st.kv_format.block_size == BS and st.capacity_blocks > 0
    assert c.info is not None and c.info.bootstrap_port == ns.bootstrap.port  # type: ignore[union-attr]
    caps = c.capabilities
    assert caps.split and caps.kv_events and caps.flush and not (caps.evict or caps.pin or caps.warm)


async def test_a_worker_that_does_not_answer_is_a_probe_failure() -> None:
    from tests.helpers import free_port

    dead = SmgNodeClient(f"grpc://127.0.0.1:{free_port()}", "127.0.0.1:1", SmgOptions())
    with pytest.raises(NodeFailure) as e:
        await dead.status(timeout=1)
    assert e.value.stage == Stage.PROBE and e.value.kind in (FailureKind.UNAVAILABLE, FailureKind.TIMEOUT)
    await dead.close()


async def test_generate_gives_the_nodes_greedy_text(nodes: StartNode, client: Client) -> None:
    ns = await nodes("monolithic")
    expected = HF.decode(await direct_ids(ns, LONG, 12))
    text, finish, completion = await collect(client(ns).generate(prompt(LONG), timeout=30))
    assert (text, finish, completion) == (expected, "length", 12)


async def test_an_engine_answering_one_complete_is_read_too(nodes: StartNode, client: Client) -> None:
    ns = await nodes("monolithic")
    expected = HF.decode(await direct_ids(ns, LONG, 12))
    s = client(ns).generate(prompt(LONG), timeout=30)
    s.engine_stream = False  # stream=false: one complete holding every output id
    assert await collect(s) == (expected, "length", 12)


async def test_stop_string_is_trimmed_and_single_token_stops_go_to_the_engine(
    nodes: StartNode, client: Client
) -> None:
    ns = await nodes("monolithic")
    expected = HF.decode(await direct_ids(ns, LONG, 24))
    words = expected.split()
    stop = " " + words[len(words) // 2]  # somewhere in the middle
    text, finish, _ = await collect(client(ns).generate(prompt(LONG, 24, (stop,)), timeout=30))
    assert finish == "stop" and text == expected[: expected.index(stop)]


async def test_repeated_prompt_reports_cached_tokens(nodes: StartNode, client: Client) -> None:
    ns = await nodes("monolithic")
    c = client(ns)
    await collect(c.generate(prompt(LONG, 2), timeout=30))
    s = c.generate(prompt(LONG, 2), timeout=30)
    await collect(s)
    assert s.cached_tokens >= (len(LONG) // BS - 1) * BS


async def test_pd_through_the_bootstrap_room(nodes: StartNode, client: Client) -> None:
    pre, dec = await nodes("prefill"), await nodes("decode")
    p, d = client(pre), client(dec)
    await p.status(timeout=5)
    expected = HF.decode(await direct_ids(dec, LONG, 12))
    assert p.handoff is not None
    for i in range(2):
        s = p.handoff.start(prompt(LONG, rid=f"pd{i}"), p, d, timeout=30)
        assert isinstance(s, BootstrapStream)
        text, finish, completion = await collect(s)
        assert (text, finish, completion) == (expected, "length", 12)
        assert s.prefill is not None
    assert s.prefill is not None and s.cached_tokens > 0  # the second one hit
    assert s.prefill.cached_tokens == s.cached_tokens


async def test_pd_prefill_failure_is_the_prefill_nodes(
    nodes: StartNode, client: Client, aborts: list[tuple[str, float]]
) -> None:
    pre = await nodes("prefill", bootstrap_port=None)  # a prefill node that cannot hand off
    dec = await nodes("decode", bootstrap_timeout_s=20.0)
    p, d = client(pre, bootstrap_port=1), client(dec)
    await p.status(timeout=5)
    assert p.handoff is not None
    s = p.handoff.start(prompt(LONG), p, d, timeout=30)
    t0 = time.monotonic()
    with pytest.raises(NodeFailure) as e:
        await s.__anext__()
    assert e.value.node_id == p.address and e.value.stage == Stage.PREFILL
    await s.aclose()
    deadline = time.monotonic() + 5
    while len({rid for rid, _ in aborts}) < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert aborts and aborts[-1][1] - t0 < 3  # the waiting decode leg was not left hanging


async def test_pd_decode_node_down_is_the_decode_nodes(nodes: StartNode, client: Client) -> None:
    pre, dec = await nodes("prefill"), await nodes("decode")
    p, d = client(pre), client(dec)
    await p.status(timeout=5)
    await d.status(timeout=5)
    await dec.stop(grace=0)
    assert p.handoff is not None
    s = p.handoff.start(prompt(LONG), p, d, timeout=10)
    with pytest.raises(NodeFailure) as e:
        await s.__anext__()
    assert e.value.node_id == d.address and e.value.kind == FailureKind.UNAVAILABLE
    await s.aclose()


async def test_close_mid_stream_aborts_the_request(
    nodes: StartNode, client: Client, aborts: list[tuple[str, float]]
) -> None:
    ns = await nodes("monolithic", time_scale=1.0)
    c = client(ns)
    s = c.generate(prompt(LONG, 400), timeout=60)
    await s.__anext__()
    await s.aclose()
    deadline = time.monotonic() + 3
    while not aborts and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert [rid for rid, _ in aborts] == [s.rid]  # type: ignore[attr-defined]
    while time.monotonic() < deadline and (await c.status(timeout=2)).running_requests:
        await asyncio.sleep(0.05)
    assert (await c.status(timeout=2)).running_requests == 0


async def test_no_abort_after_normal_completion(
    nodes: StartNode, client: Client, aborts: list[tuple[str, float]]
) -> None:
    ns = await nodes("monolithic")
    await collect(client(ns).generate(prompt(LONG, 4), timeout=30))
    await asyncio.sleep(0.2)
    assert aborts == []


async def test_pd_close_aborts_prefill_at_once_and_decode_after_its_first_item(
    nodes: StartNode, client: Client, aborts: list[tuple[str, float]]
) -> None:
    pre, dec = await nodes("prefill", time_scale=400.0), await nodes("decode")
    p, d = client(pre), client(dec)
    await p.status(timeout=5)
    assert p.handoff is not None
    s = p.handoff.start(prompt(LONG, 50), p, d, timeout=30)
    first = asyncio.ensure_future(s.__anext__())
    await asyncio.sleep(0.3)
    assert not first.done()
    first.cancel()
    t0 = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await first
    deadline = time.monotonic() + 10
    while len(aborts) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert len(aborts) == 2 and {rid for rid, _ in aborts} == {s.rid}  # type: ignore[attr-defined]
    assert aborts[0][1] - t0 < 1.0  # the prefill leg: at once


async def test_kv_events_fill_the_index_with_the_gateways_hashes(nodes: StartNode) -> None:
    ns = await nodes("monolithic")
    opts = SmgOptions(block_size=BS, root_of=root_of, codec=HF)
    pool = NodePool(0.2, connect=lambda a: SmgNodeClient(a, a.removeprefix("grpc://"), opts))
    index = MemoryIndex()
    sync = EventSync(pool, index, Metrics(), retry_s=0.1)
    node = pool.add("monolithic", f"grpc://{ns.address}")
    try:
        assert await pool.wait_ready(5)
        sync.watch(node)
        p = prompt(LONG, 2)
        await collect(node.client.generate(p, timeout=30))
        want = len(p.hashes)
        deadline = time.monotonic() + 5
        hits: dict[str, int] = {}
        while time.monotonic() < deadline:
            hits = await index.lookup(p.hashes)
            if hits.get(node.id) == want:
                break
            await asyncio.sleep(0.05)
        assert hits.get(node.id) == want
        # a whole-node flush (the only eviction this protocol has) empties it again
        await node.client.evict([], everything=True, timeout=5)
        while time.monotonic() < deadline + 5 and (await index.lookup(p.hashes)).get(node.id):
            await asyncio.sleep(0.05)
        assert not (await index.lookup(p.hashes)).get(node.id)
    finally:
        await sync.close()
        await pool.close()


async def test_a_token_holding_half_a_character_has_its_own_bytes() -> None:
    """Its text is U+FFFD (decoded alone), its bytes are its own, as OpenAI gives them (the tiny
    engine never outputs such a token: the engine's log probability is given here)."""
    from prefixgate.gateway.httpfront.responses import chat_logprobs

    c = SmgNodeClient("grpc://127.0.0.1:9", "127.0.0.1:9", SmgOptions(codec=HF))  # never dialled
    half, rest = HF.encode("é", add_special_tokens=False).ids
    lp = c.token_logprob((half, -0.5, ((rest, -0.1), (half, -0.5), (rest, -0.1))), 2)
    assert lp.text == "\ufffd" and lp.raw == "é".encode()[:1]
    assert lp.top == (("\ufffd", -0.1), ("\ufffd", -0.5))  # most likely first, each id once
    assert lp.top_raw == ("é".encode()[1:], "é".encode()[:1])
    entry = chat_logprobs([lp])["content"][0]
    assert entry["bytes"] == [0xC3] and [a["bytes"] for a in entry["top_logprobs"]] == [[0xA9], [0xC3]]
    plain = c.token_logprob((HF.token_to_id("Ġthe") or 0, -1.0, ()), 0)
    assert plain.text == " the" and plain.raw is None and plain.top == ()
    assert chat_logprobs([plain])["content"][0]["bytes"] == list(b" the")
    await c.close()


async def test_log_probabilities_stop_with_the_text(nodes: StartNode, client: Client) -> None:
    """One a token, spelling the text; a stop string the gateway matches ends them with the text."""
    ns = await nodes("monolithic", engine="tiny:preset=small")
    c = client(ns)
    plain = prompt(LONG, max_tokens=8)
    plain.sampling.logprobs = True
    deltas = [d async for d in c.generate(plain, timeout=30)]
    tokens = [lp.text for d in deltas for lp in d.logprobs]
    assert len(tokens) == 8 and "".join(tokens) == "".join(d.text for d in deltas)
    assert all(lp.top == () for d in deltas for lp in d.logprobs)  # no alternatives asked
    stop = tokens[3][-1:] if tokens[3].strip() else tokens[3]
    cut = next(i for i, t in enumerate(tokens) if stop in t)
    stopped = prompt(LONG, max_tokens=8, stop=(stop,))
    stopped.sampling.logprobs = True
    out = [d async for d in c.generate(stopped, timeout=30)]
    assert len([lp for d in out for lp in d.logprobs]) == cut + 1  # up to the token that stopped it
    assert out[-1].finish_reason == "stop"


class _BadPageSize(doubles.ScriptedSglang):
    """An engine whose server info says ``page_size`` "abc" (a value no adapter can read)."""

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        args = struct_pb2.Struct()
        args.update({"page_size": "abc", "disaggregation_mode": "null"})
        return pb.GetServerInfoResponse(server_args=args)


async def test_an_unreadable_status_is_a_failed_probe_and_the_probes_go_on() -> None:
    server, addr = await doubles.serve(doubles.add_sglang(_BadPageSize(None)))
    opts = SmgOptions(block_size=BS, root_of=root_of, codec=HF)
    pool = NodePool(0.05, connect=lambda a: SmgNodeClient(a, a.removeprefix("grpc://"), opts))
    try:
        node = pool.add("monolithic", f"grpc://{addr}")
        node.reachable = True  # as it was before its engine started answering nonsense
        assert await pool.refresh(node) is False
        assert not node.reachable and "unreadable status" in node.last_error
        failures = node.probe_failures
        await asyncio.sleep(0.3)  # the poll keeps probing (and failing), it did not die
        assert node.probe_failures > failures and not node.routable
    finally:
        await pool.close()
        await server.stop(0)


async def test_a_long_prompt_is_sent_serialized_off_the_loop_and_arrives_whole(
    nodes: StartNode, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt past ``REQUEST_OFF_LOOP_BYTES`` has its ids made into the request's field on a
    worker thread, a short one on the event loop; both go as bytes (the call without a
    serializer): the engine gets every id, and answers as it does directly."""
    from prefixgate.gateway.nodeclient import smg_common
    from prefixgate.gateway.nodeclient.smg_common import REQUEST_OFF_LOOP_BYTES
    from prefixgate.gateway.nodeclient.smg_prompt import tokenized_field

    seen: list[list[int]] = []
    original = SglangSchedulerService.Generate

    async def recording(self: SglangSchedulerService, request: Any, context: Any) -> AsyncIterator[Any]:
        seen.append(list(request.tokenized.input_ids))
        async for msg in original(self, request, context):
            yield msg

    monkeypatch.setattr(SglangSchedulerService, "Generate", recording)  # before the node starts
    ns = await nodes("monolithic")
    ids = [1_000 + (i * 7919) % 20_000 for i in range(REQUEST_OFF_LOOP_BYTES // 4 + 500)]
    expected = HF.decode(await direct_ids(ns, ids, 4))
    c = client(ns)
    sent: list[type] = []
    built_on: list[bool] = []  # each request's ids made on the event loop's thread?
    call, build = c.generate_call, tokenized_field

    def spying(request: Any, timeout: float, **kw: Any) -> Any:
        sent.append(type(request))
        return call(request, timeout, **kw)

    def building(*args: Any, **kw: Any) -> Any:
        built_on.append(threading.current_thread() is threading.main_thread())
        return build(*args, **kw)

    monkeypatch.setattr(c, "generate_call", spying)
    monkeypatch.setattr(smg_common, "tokenized_field", building)
    s = c.generate(prompt(ids, 4), timeout=30)
    assert await collect(s) == (expected, "length", 4)
    assert seen == [ids, ids]  # directly, then through the adapter
    short = c.generate(prompt(LONG, 4), timeout=30)
    await collect(short)
    assert seen[-1] == LONG
    assert sent == [bytes, bytes] and built_on == [False, True]
