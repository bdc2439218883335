"""The adapter for prefixgate's own node protocol (``prefixgate.v1.Node`` over gRPC).

Everything wire-specific about our nodes lives here and nowhere else in the gateway: the channel
options, the metadata keys, the generated messages, and how a gRPC status (plus the node's
``x-prefixgate-stage`` trailer) becomes a ``NodeFailure`` with a kind and a stage. Split serving
is ``PushHandoff``: the prefill node computes the prompt and pushes the KV pages to the decode
node itself, answering with a handle that the decode node's stream then continues from.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import grpc

from prefixgate.backends.stats import node_status
from prefixgate.gateway import tracing
from prefixgate.gateway.nodeclient.base import (
    Capabilities,
    FailedStream,
    KVEvent,
    NodeClient,
    NodeFailure,
    NodeStatus,
    PrefillReport,
    Prompt,
    StageTimings,
    TokenDelta,
    TokenLogprob,
)
from prefixgate.gateway.vocab import EventKind, FailureKind, Stage
from prefixgate.openai.schema import Sampling
from prefixgate.v1 import node_pb2, node_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 0),
    # A node back from a restart is reconnected within 2 s (gRPC's default backoff grows to 120 s),
    # so the health probe sees it, and lets it rejoin, as soon as it answers.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
REQUEST_ID_KEY = "x-prefixgate-request-id"
STAGE_KEY = "x-prefixgate-stage"  # trailing metadata: where along the node's work it failed
CAPABILITIES = Capabilities(
    split=True,
    kv_events=True,
    pin=True,
    evict=True,
    warm=True,
    tenant_salt=True,
    resume=True,
    resume_constrained=True,
    block_hashes=True,
)

# Why a status code means what it means on our nodes (backends/server.py documents the codes).
KINDS: dict[grpc.StatusCode, FailureKind] = {
    grpc.StatusCode.UNAVAILABLE: FailureKind.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: FailureKind.TIMEOUT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: FailureKind.OVERLOADED,
    grpc.StatusCode.NOT_FOUND: FailureKind.HANDLE_GONE,  # Decode on an unknown or expired kv handle
    grpc.StatusCode.FAILED_PRECONDITION: FailureKind.FORMAT_REFUSED,  # KV pages in another format
    grpc.StatusCode.CANCELLED: FailureKind.CANCELLED,
    grpc.StatusCode.INVALID_ARGUMENT: FailureKind.INVALID,
    grpc.StatusCode.OUT_OF_RANGE: FailureKind.INVALID,
    grpc.StatusCode.UNIMPLEMENTED: FailureKind.INVALID,
}

_EVENT_KINDS = {
    node_pb2.KVEvent.STORED: EventKind.STORED,
    node_pb2.KVEvent.REMOVED: EventKind.REMOVED,
    node_pb2.KVEvent.CLEARED: EventKind.CLEARED,
    node_pb2.KVEvent.SNAPSHOT: EventKind.SNAPSHOT,
}


def failure(node_id: str, stage: Stage, err: BaseException) -> NodeFailure:
    """A failed call on a node, in the gateway's words."""
    if isinstance(err, grpc.aio.AioRpcError):
        kind = KINDS.get(err.code(), FailureKind.INTERNAL)
        return NodeFailure(node_id, stage, kind, f"{err.code().name}: {err.details() or ''}")
    if isinstance(err, TimeoutError):
        return NodeFailure(node_id, stage, FailureKind.TIMEOUT, "timed out")
    return NodeFailure(node_id, stage, FailureKind.INTERNAL, repr(err))


def failed_stage(err: grpc.aio.AioRpcError) -> str:
    """The stage our node names in its trailer (older nodes: guessed from the message)."""
    for key, value in err.trailing_metadata() or ():
        if key == STAGE_KEY:
            return str(value)
    details = (err.details() or "").lower()
    return "transfer" if "transfer" in details and "decode" in details else ""


def sampling_message(s: Sampling) -> node_pb2.SamplingParams:
    return node_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=(s.seed or 0) & 0xFFFFFFFFFFFFFFFF,
        has_seed=s.seed is not None,
        stop=s.stop,
        choice=s.choice,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        logit_bias=s.logit_bias,
    )


def int32(v: int) -> int:
    """``v`` within the wire's int32 (a priority beyond it means the same as its bound)."""
    return max(-(2**31), min(2**31 - 1, v))


def token_logprob(msg: node_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.text, msg.logprob, tuple((t.text, t.logprob) for t in msg.top))


def chunk_logprobs(chunk: node_pb2.TokenChunk) -> tuple[TokenLogprob, ...]:
    return tuple(token_logprob(m) for m in chunk.logprobs) if chunk.logprobs else ()


def chunk_delta(chunk: node_pb2.TokenChunk) -> TokenDelta:
    return TokenDelta(
        chunk.text,
        chunk.finish_reason,
        chunk.completion_tokens,
        chunk_logprobs(chunk),
        token_ids=tuple(chunk.token_ids),
    )


def kv_event(msg: node_pb2.KVEvent) -> KVEvent:
    return KVEvent(
        seq=msg.seq,
        instance_id=msg.instance_id,
        kind=_EVENT_KINDS[msg.kind],
        parent=msg.parent_hash,
        hashes=tuple(msg.block_hashes),
        parents=tuple(msg.parent_hashes),
    )


def _metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    """The request's id and its trace context (``gateway.tracing``: the engine joins the trace)."""
    return ((REQUEST_ID_KEY, request_id), *tracing.CONTEXT.get())


class _ChunkStream:
    """A ``TokenChunk`` stream (Generate or Decode) as a TokenStream."""

    def __init__(self, node_id: str, stage: Stage) -> None:
        self.node_id = node_id
        self.stage = stage
        self.cached_tokens = 0
        self.timings = StageTimings()
        self.prefill: PrefillReport | None = None
        self._call: Any = None  # grpc.aio.UnaryStreamCall, untyped in the stubs
        self._pending: list[TokenDelta] = []
        self._chunks = 0
        self._closed = False

    def __aiter__(self) -> _ChunkStream:
        return self

    def _open(self) -> Any:
        raise NotImplementedError

    async def _before(self) -> None:
        """Work before the token stream opens (a handoff's prefill leg)."""

    async def __anext__(self) -> TokenDelta:
        if self._pending:
            return self._pending.pop(0)
        if self._closed:
            raise StopAsyncIteration
        if self._call is None:
            await self._before()
            if self._pending:
                return self._pending.pop(0)
            self._call = self._open()
        try:
            chunk = await self._call.read()
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            await self.aclose()
            raise failure(self.node_id, self.stage, e) from e
        if chunk is grpc.aio.EOF:
            await self.aclose()
            what = "before any token" if self._chunks == 0 else "without finishing"
            raise NodeFailure(self.node_id, self.stage, FailureKind.INTERNAL, f"stream ended {what}")
        return self._delta(chunk)

    def _delta(self, chunk: node_pb2.TokenChunk) -> TokenDelta:
        if self._chunks == 0 and (chunk.queue_seconds or chunk.prefill_seconds):
            self.timings.queue_s, self.timings.prefill_s = chunk.queue_seconds, chunk.prefill_seconds
        if chunk.cached_tokens:  # usage rides on the first and the last chunk
            self.cached_tokens = chunk.cached_tokens
        self._chunks += 1
        if chunk.finish_reason:
            self._closed = True
        return chunk_delta(chunk)

    async def aclose(self) -> None:
        self._closed = True
        self._pending.clear()
        if self._call is not None and not self._call.done():  # a finished call has nothing to cancel
            self._call.cancel()


class _GenerateStream(_ChunkStream):
    def __init__(self, client: GrpcNodeClient, prompt: Prompt, timeout: float) -> None:
        super().__init__(client.address, Stage.GENERATE)
        self._client, self._prompt, self._timeout = client, prompt, timeout

    def _open(self) -> Any:
        p = self._prompt
        return self._client.stub.Generate(
            node_pb2.GenerateRequest(
                request_id=p.request_id,
                tokens=p.tokens,
                block_hashes=p.hashes,
                sampling=sampling_message(p.sampling),
                resumed=p.resumed,
                priority=int32(p.priority),
            ),
            timeout=self._timeout,
            metadata=_metadata(p.request_id),
        )


class _PushStream(_ChunkStream):
    """Prefill (which pushes the KV pages to the decode node), then Decode on the handle."""

    def __init__(
        self, prefill: GrpcNodeClient, decode: GrpcNodeClient, prompt: Prompt, timeout: float
    ) -> None:
        super().__init__(decode.address, Stage.DECODE)
        self._p, self._d, self._prompt = prefill, decode, prompt
        self._deadline = asyncio.get_running_loop().time() + timeout
        self._handle = ""
        self._finished_early = False
        self.on_prefill: Callable[[], None] | None = None  # ``base.PrefillWatched``

    def _left(self) -> float:
        return max(0.01, self._deadline - asyncio.get_running_loop().time())

    async def _before(self) -> None:
        p = self._prompt
        try:
            resp = await self._p.stub.Prefill(
                node_pb2.PrefillRequest(
                    request_id=p.request_id,
                    tokens=p.tokens,
                    block_hashes=p.hashes,
                    sampling=sampling_message(p.sampling),
                    decode_address=self._d.address,
                    resumed=p.resumed,
                    priority=int32(p.priority),
                ),
                timeout=self._left(),
                metadata=_metadata(p.request_id),
            )
        except grpc.aio.AioRpcError as e:
            self._closed = True
            if failed_stage(e) == "transfer":  # the decode node refused or lost the pages
                raise failure(self._d.address, Stage.TRANSFER, e) from e
            raise failure(self._p.address, Stage.PREFILL, e) from e
        except TimeoutError as e:
            self._closed = True
            raise failure(self._p.address, Stage.PREFILL, e) from e
        self.prefill = PrefillReport(
            resp.cached_tokens,
            resp.queue_seconds,
            resp.prefill_seconds,
            resp.transfer_seconds,
            resp.transfer_bytes,
        )
        if self.on_prefill is not None:
            self.on_prefill()
        self.cached_tokens = resp.cached_tokens
        self.timings = StageTimings(resp.queue_seconds, resp.prefill_seconds, resp.transfer_seconds)
        self._handle = resp.kv_handle
        self._call = self._open()
        # Read the decode node's first chunk before the first token goes out, so a decode node
        # that cannot continue fails the attempt while another pair can still be tried.
        try:
            chunk = await self._call.read()
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            await self.aclose()
            raise failure(self._d.address, Stage.DECODE, e) from e
        if chunk is grpc.aio.EOF:
            await self.aclose()
            raise NodeFailure(
                self._d.address, Stage.DECODE, FailureKind.INTERNAL, "decode stream ended before any token"
            )
        first_lp = (token_logprob(resp.first_logprob),) if resp.HasField("first_logprob") else ()
        if resp.finished:  # the first token ended it: decode only confirms with the usage chunk
            self._closed = True
            self._pending = [
                TokenDelta(resp.first_text, resp.finish_reason, max(1, chunk.completion_tokens), first_lp)
            ]
        else:  # the prefill node's token is output like the decode node's (a migration's ids)
            first = TokenDelta(resp.first_text, "", p.resumed + 1, first_lp, token_ids=(resp.first_token,))
            self._pending = [first, self._delta(chunk)]
        self._chunks = 1

    def _open(self) -> Any:
        p = self._prompt
        return self._d.stub.Decode(
            node_pb2.DecodeRequest(
                request_id=p.request_id,
                kv_handle=self._handle,
                sampling=sampling_message(p.sampling),
                resumed=p.resumed,
            ),
            timeout=self._left(),
            metadata=_metadata(p.request_id),
        )

    def _delta(self, chunk: node_pb2.TokenChunk) -> TokenDelta:
        if chunk.finish_reason and chunk.cached_tokens:
            self.cached_tokens = chunk.cached_tokens
        self._chunks += 1
        if chunk.finish_reason:
            self._closed = True
        return chunk_delta(chunk)


class PushHandoff:
    """Our nodes' split serving: the prefill node pushes KV to the decode node, which continues."""

    def start(
        self, prompt: Prompt, prefill: NodeClient, decode: NodeClient, *, timeout: float
    ) -> _PushStream | FailedStream:
        if not isinstance(prefill, GrpcNodeClient) or not isinstance(decode, GrpcNodeClient):
            refused = "only a prefixgate node takes pages pushed by a prefixgate node"
            return FailedStream(
                NodeFailure(decode.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED, refused)
            )
        return _PushStream(prefill, decode, prompt, timeout)


PUSH_HANDOFF = PushHandoff()


class GrpcNodeClient:
    """A node speaking ``prefixgate.v1.Node``."""

    def __init__(self, address: str) -> None:
        self._address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = node_pb2_grpc.NodeStub(self.channel)

    @property
    def address(self) -> str:
        return self._address

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def handoff(self) -> PushHandoff:
        return PUSH_HANDOFF

    async def status(self, timeout: float) -> NodeStatus:
        try:
            msg = await self.stub.Stats(node_pb2.StatsRequest(), timeout=timeout)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            raise failure(self._address, Stage.PROBE, e) from e
        return node_status(msg)

    def generate(self, prompt: Prompt, *, timeout: float) -> _GenerateStream:
        return _GenerateStream(self, prompt, timeout)

    async def kv_events(self, since_seq: int) -> AsyncGenerator[KVEvent, None]:
        call = self.stub.KVEvents(node_pb2.KVEventsRequest(since_seq=since_seq))
        try:
            async for msg in call:
                yield kv_event(msg)
        except grpc.aio.AioRpcError as e:
            raise failure(self._address, Stage.EVENTS, e) from e
        finally:
            call.cancel()

    async def warm(self, prompt: Prompt, *, pin_seconds: float, timeout: float) -> PrefillReport:
        try:
            resp = await self.stub.Prefill(
                node_pb2.PrefillRequest(
                    request_id=prompt.request_id,
                    tokens=prompt.tokens,
                    block_hashes=prompt.hashes,
                    sampling=node_pb2.SamplingParams(max_tokens=1),
                    decode_address="",
                    pin_seconds=pin_seconds,
                    skip_first_token=True,
                    priority=int32(prompt.priority),
                ),
                timeout=timeout,
                metadata=_metadata(prompt.request_id),
            )
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            raise failure(self._address, Stage.PREFILL, e) from e
        return PrefillReport(resp.cached_tokens, resp.queue_seconds, resp.prefill_seconds, 0.0, 0)

    async def evict(self, hashes: Sequence[int], *, everything: bool, timeout: float) -> list[int]:
        try:
            resp = await self.stub.Evict(
                node_pb2.EvictRequest(block_hashes=list(hashes), all=everything), timeout=timeout
            )
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            raise failure(self._address, Stage.CACHE, e) from e
        return list(resp.evicted)

    async def pin(self, hashes: Sequence[int], *, seconds: float, timeout: float) -> tuple[int, int]:
        try:
            resp = await self.stub.Pin(
                node_pb2.PinRequest(block_hashes=list(hashes), pin_seconds=seconds), timeout=timeout
            )
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            raise failure(self._address, Stage.CACHE, e) from e
        return resp.pinned, resp.missing

    async def close(self) -> None:
        await self.channel.close()
