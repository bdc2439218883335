"""The node's gRPC server, on grpc.aio: ``prefixgate.v1.Node`` (the gateway's native protocol),
``sglang.grpc.scheduler.SglangScheduler`` (the SMG engine protocol, ``backends.smg_service``),
standard health and reflection, all on one port; a prefill node with a bootstrap port also
listens there for PD handoffs (``backends.bootstrap``).

Status codes (trailing metadata ``x-prefixgate-stage`` says where it failed):

- INVALID_ARGUMENT: malformed request (tokens not packed uint32, block_hashes count not
  ``len(tokens) // 4 // block_size``, a malformed transfer stream), a prompt over the node's
  context, i.e. larger than its whole KV pool (``pool``; no wait makes it fit).
- RESOURCE_EXHAUSTED: prefill queue full (stage ``queue``), KV pool full of referenced or pinned
  blocks or a transferred prompt larger than the pool (``pool``), too many decode streams
  (``decode``).
- FAILED_PRECONDITION: KV format differs between sender and receiver (message names each field).
- NOT_FOUND: Decode with an unknown, used or expired ``kv_handle``.
- DATA_LOSS: a KV page's checksum does not match its bytes.
- ALREADY_EXISTS: a transfer reusing a pending ``kv_handle``.
- Prefill with ``decode_address``: a failed push returns the decode node's own code (UNAVAILABLE
  when unreachable), message ``KV transfer to decode node ADDR failed (CODE): ...``, stage
  ``transfer``. The pages are pushed even when the first token ends generation, so Decode on the
  handle always works (it then streams only the final chunk with usage).

Stats: ``profile`` holds wall-clock figures (the hardware profile multiplied by ``time_scale``,
also reported), so ``gateway.routing.base.prefill_seconds`` over them gives real seconds;
``profile.transfer_bytes_per_s`` is in shipped bytes (``kv_format.bytes_per_token`` a token),
measured on this node's transfers of 1 MiB or more. ``queued_tokens`` is the prefill work ahead
of a new arrival (waiting prompts' uncached tokens plus what running prefills have left);
``running_requests`` counts prefills computing and decode/generate streams. ``used_blocks`` is what
the pool holds, cached blocks included; ``evictable_blocks`` of them nobody references or pins
(the next prefill may take them back), so blocks in use are ``used_blocks - evictable_blocks``,
the figure the SGLang-protocol face reports as ``num_used_tokens`` / ``token_usage``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefixgate.backends.bootstrap import DEFAULT_BOOTSTRAP_TIMEOUT_S, BootstrapServer
from prefixgate.backends.convert import (
    chunk_to_proto,
    event_to_proto,
    header_from_proto,
    page_from_proto,
    prefill_to_proto,
    sampling_from_proto,
)
from prefixgate.backends.engine import MAX_GROUP, Engine
from prefixgate.backends.errors import InvalidArgument, NodeError, abort_rpc
from prefixgate.backends.kvclient import CACHED_TOKENS_KEY, CHANNEL_OPTIONS, REQUEST_ID_KEY, GrpcKVSender
from prefixgate.backends.kvpages import DEFAULT_KV_SCALE
from prefixgate.backends.node import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_CHUNKED_PREFILL,
    DEFAULT_SCHEDULING_POLICY,
    Node,
    NodeConfig,
    PrefillCall,
)
from prefixgate.backends.profiles import get_profile
from prefixgate.backends.stats import stats_message
from prefixgate.backends.transfer import WirePage
from prefixgate.gateway import tracing
from prefixgate.v1 import node_pb2, node_pb2_grpc

if TYPE_CHECKING:
    from prefixgate.backends.http_api import HTTPOptions, NodeHTTP

log = structlog.get_logger("prefixgate.node")

STAGE_KEY = "x-prefixgate-stage"
SLOWDOWN_FACTOR = 10.0
NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name
SERVER_OPTIONS: list[tuple[str, Any]] = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


def _metadata(context: Any, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return str(v)
    return ""


def _bind(context: Any, request_id: str, node_id: str) -> str:
    """Request id into this rpc's log lines (each rpc runs in its own task and context)."""
    rid = request_id or _metadata(context, REQUEST_ID_KEY)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=rid, node_id=node_id)
    tracing.received(_metadata(context, tracing.TRACEPARENT_KEY))
    return rid


async def _abort(context: Any, e: NodeError) -> None:
    await abort_rpc(context, e, ((STAGE_KEY, e.stage),))


NATIVE_UNSERVED = frozenset({"response_format"})
#: How long a refused transfer's remaining pages are read before the refusal is sent (``_drain``)
REFUSED_DRAIN_S = 5.0


async def _drain(chunks: AsyncIterator[Any], seconds: float = REFUSED_DRAIN_S) -> None:
    """Read what the sender still streams before refusing its transfer. grpcio's asyncio client
    lets a write that fails because the server already ended the call overwrite the status the
    server sent: the sender's call then ends INTERNAL ("Internal error from Core") instead of
    with the refusal's code, by which the gateway tells a KV format mismatch
    (FAILED_PRECONDITION) from a failed node. Seen once in the suite's PD format test. Read to
    its end (``seconds`` at most), the sender has half-closed before the refusal comes."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(seconds):
            async for _ in chunks:
                pass


class NodeService(node_pb2_grpc.NodeServicer):
    """Translates between the wire and ``backends.node.Node``."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def Prefill(self, request: node_pb2.PrefillRequest, context: Any) -> node_pb2.PrefillResponse:
        rid = _bind(context, request.request_id, self.node.node_id)
        call = PrefillCall(
            request_id=rid,
            tokens=request.tokens,
            block_hashes=list(request.block_hashes),
            sampling=sampling_from_proto(request.sampling),
            decode_address=request.decode_address,
            pin_seconds=request.pin_seconds,
            skip_first_token=request.skip_first_token,
            timeout=context.time_remaining(),
            resumed=request.resumed,
            priority=request.priority,
        )
        try:
            r = await self.node.prefill(call)
        except NodeError as e:
            await _abort(context, e)
            raise  # not reached: abort raises
        return prefill_to_proto(r, self.node.engine.token_text)

    async def Decode(
        self, request: node_pb2.DecodeRequest, context: Any
    ) -> AsyncIterator[node_pb2.TokenChunk]:
        _bind(context, request.request_id, self.node.node_id)
        sampling = sampling_from_proto(request.sampling) if request.HasField("sampling") else None
        try:
            async for chunk in self.node.decode(request.kv_handle, sampling, request.resumed):
                yield chunk_to_proto(chunk, self.node.engine.token_text)
        except NodeError as e:
            await _abort(context, e)

    async def Generate(
        self, request: node_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[node_pb2.TokenChunk]:
        _bind(context, request.request_id, self.node.node_id)
        sampling = sampling_from_proto(request.sampling)
        try:
            async for chunk in self.node.generate(
                request.tokens, list(request.block_hashes), sampling, request.resumed, request.priority
            ):
                yield chunk_to_proto(chunk, self.node.engine.token_text)
        except NodeError as e:
            await _abort(context, e)

    async def TransferKV(
        self, request_iterator: AsyncIterator[node_pb2.KVTransferChunk], context: Any
    ) -> node_pb2.KVTransferAck:
        _bind(context, "", self.node.node_id)
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or not first.HasField("header"):
                raise InvalidArgument("a transfer starts with a KVTransferHeader", stage="transfer")
            header = header_from_proto(first.header)
            if header.request_id:
                structlog.contextvars.bind_contextvars(request_id=header.request_id)

            async def pages() -> AsyncIterator[WirePage]:
                async for msg in request_iterator:
                    if not msg.HasField("page"):
                        raise InvalidArgument("only the first message may be a header", stage="transfer")
                    yield page_from_proto(msg.page)

            cached_text = _metadata(context, CACHED_TOKENS_KEY)
            cached = int(cached_text) if cached_text.isdigit() else 0
            ack = await self.node.receive(header, pages(), cached)
        except NodeError as e:
            await _drain(request_iterator)
            await _abort(context, e)
            raise
        return node_pb2.KVTransferAck(
            kv_handle=ack.kv_handle, pages=ack.pages, bytes=ack.bytes, reused_pages=ack.reused_pages
        )

    async def Stats(self, request: node_pb2.StatsRequest, context: Any) -> node_pb2.NodeStats:
        # this protocol's SamplingParams carry no constraint: constrained decoding is served on
        # the SMG and HTTP faces only
        snapshot = self.node.snapshot()
        return stats_message(snapshot, snapshot.features - NATIVE_UNSERVED)

    async def KVEvents(
        self, request: node_pb2.KVEventsRequest, context: Any
    ) -> AsyncIterator[node_pb2.KVEvent]:
        iid = self.node.events.instance_id
        async for rec in self.node.events.follow(request.since_seq):
            yield event_to_proto(rec, iid)

    async def Evict(self, request: node_pb2.EvictRequest, context: Any) -> node_pb2.EvictResponse:
        evicted = self.node.evict(list(request.block_hashes), everything=request.all)
        return node_pb2.EvictResponse(evicted=evicted)

    async def Pin(self, request: node_pb2.PinRequest, context: Any) -> node_pb2.PinResponse:
        pinned, missing = self.node.pin(list(request.block_hashes), request.pin_seconds)
        return node_pb2.PinResponse(pinned=pinned, missing=missing)


def make_engine(
    engine: str,
    role: str,
    *,
    profile: str | None = None,
    block_size: int = 64,
    time_scale: float = 1.0,
    kv_scale: float = DEFAULT_KV_SCALE,
) -> Engine:
    if engine == "sim":
        from prefixgate.backends.sim.engine import SimEngine

        return SimEngine(
            get_profile(profile, role), block_size=block_size, time_scale=time_scale, kv_scale=kv_scale
        )
    if engine == "tiny" or engine.startswith("tiny:"):
        from prefixgate.backends.tiny.engine import make_engine as make_tiny

        return make_tiny(engine, block_size=block_size, profile=profile)
    raise ValueError(f"unknown engine {engine!r}: available: sim, tiny[:key=value,...]")


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class NodeServer:
    """A node and its gRPC server. ``start`` binds (port 0 = a free one) and returns the port.

    ``bootstrap_port`` (0: a free one; None: none) opens the PD bootstrap listener of a prefill
    node; ``served_model_name`` names the model on the SMG engine protocol."""

    def __init__(
        self,
        node: Node,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        bootstrap_port: int | None = None,
        bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S,
        served_model_name: str | None = None,
    ) -> None:
        self.node = node
        self.host = host
        self.port = port
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.http: NodeHTTP | None = None  # the OpenAI-compatible HTTP endpoint, when served
        self.bootstrap = (
            BootstrapServer(host, bootstrap_port, bootstrap_timeout_s) if bootstrap_port is not None else None
        )
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.served_model_name = served_model_name or f"prefixgate-{node.engine.name}"

    @property
    def address(self) -> str:
        return _host_port(self.host, self.port)

    async def start(self) -> int:
        from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc

        from prefixgate.backends.hftok import load as load_tokenizer
        from prefixgate.backends.smg_service import SGLANG_SERVICE, SglangSchedulerService

        server = grpc.aio.server(options=SERVER_OPTIONS)
        node_pb2_grpc.add_NodeServicer_to_server(NodeService(self.node), server)
        smg = SglangSchedulerService(
            self.node,
            load_tokenizer(),
            served_model_name=self.served_model_name,
            kv_address=lambda: self.address,
            bootstrap=self.bootstrap,
            bootstrap_timeout_s=self.bootstrap_timeout_s,
        )
        sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(smg, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                NODE_SERVICE,
                SGLANG_SERVICE,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        bound = int(server.add_insecure_port(_host_port(self.host, self.port)))
        if not bound:
            raise OSError(f"cannot bind {_host_port(self.host, self.port)}")
        self.port = bound
        if not self.node.node_id:
            self.node.node_id = self.address
        if self.bootstrap is not None:
            await self.bootstrap.start()
        await self.node.start()
        await server.start()
        self.server = server
        for service in ("", NODE_SERVICE, SGLANG_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "node started",
            node_id=self.node.node_id,
            role=self.node.config.role,
            address=self.address,
            engine=self.node.engine.name,
            profile=self.node.engine.profile.name,
            time_scale=self.node.engine.time_scale,
            instance_id=self.node.events.instance_id,
            bootstrap_port=self.bootstrap.port if self.bootstrap is not None else None,
        )
        return bound

    async def stop(self, grace: float = 1.0) -> None:
        if self.server is None:
            return
        server, self.server = self.server, None
        if self.http is not None:
            http, self.http = self.http, None
            await http.stop()
        await self.health.enter_graceful_shutdown()
        if self.bootstrap is not None:
            await self.bootstrap.stop()
        self.node.events.close()  # end KVEvents streams so the grace period is not spent on them
        await server.stop(grace)
        await self.node.close()
        log.info("node stopped", node_id=self.node.node_id)

    async def wait(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()


async def start_node(
    role: str = "monolithic",
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    engine: str = "sim",
    profile: str | None = None,
    capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    block_size: int = 64,
    time_scale: float = 1.0,
    kv_scale: float = DEFAULT_KV_SCALE,
    node_id: str | None = None,
    max_queue: int = 64,
    max_concurrency: int = 1,
    max_decode_streams: int = 256,
    handle_ttl_s: float = 60.0,
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL,
    bootstrap_port: int | None = None,
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S,
    served_model_name: str | None = None,
    context_length: int = 0,
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY,
    stream_interval: int = MAX_GROUP,
) -> NodeServer:
    """Start a node in the running event loop; ``await server.stop()`` to stop it."""
    eng = make_engine(
        engine, role, profile=profile, block_size=block_size, time_scale=time_scale, kv_scale=kv_scale
    )
    config = NodeConfig(
        role=role,
        node_id=node_id or "",
        capacity_blocks=capacity_blocks,
        max_queue=max_queue,
        max_concurrency=max_concurrency,
        max_decode_streams=max_decode_streams,
        handle_ttl_s=handle_ttl_s,
        chunked_prefill_size=chunked_prefill_size,
        context_length=context_length,
        scheduling_policy=scheduling_policy,
        stream_interval=stream_interval,
    )
    ns = NodeServer(
        Node(eng, config, GrpcKVSender()),
        host,
        port,
        bootstrap_port=bootstrap_port,
        bootstrap_timeout_s=bootstrap_timeout_s,
        served_model_name=served_model_name,
    )
    await ns.start()
    return ns


async def serve(
    role: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    on_ready: Callable[[NodeServer], None] | None = None,
    http_port: int | None = None,
    http_options: HTTPOptions | None = None,
    **node_options: Any,
) -> None:
    """Run one node until SIGINT/SIGTERM (or cancellation), then stop it cleanly.

    ``node_options`` are ``start_node``'s; ``on_ready(server)`` is called once the port is bound.
    ``http_port`` (0: a free one) also serves the OpenAI-compatible endpoint of
    ``backends.http_api`` on the same host, in this loop.
    """
    ns = await start_node(role, host, port, **node_options)
    if http_port is not None:
        from prefixgate.backends.http_api import NodeHTTP, PDLink

        pd = PDLink(lambda: ns.address, ns.bootstrap, host, ns.bootstrap_timeout_s)
        ns.http = NodeHTTP(ns.node, host, http_port, http_options, pd)
        try:
            await ns.http.start()
        except OSError:
            ns.http = None
            await ns.stop()
            raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    running = ns.node.engine
    if hasattr(running, "slowdown"):
        # Fault injection for drills and tests: SIGUSR1 makes this node 10x slower than it
        # reports, SIGUSR2 restores it.
        for sig, factor in ((signal.SIGUSR1, SLOWDOWN_FACTOR), (signal.SIGUSR2, 1.0)):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, setattr, running, "slowdown", factor)
                installed.append(sig)
    try:
        if on_ready is not None:
            on_ready(ns)
        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await ns.stop()
