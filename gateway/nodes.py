"""The gateway's view of its nodes: channels, polled stats, local load, health."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc

from gateway.breaker import CircuitBreaker
from gateway.routing import KVFormat, NodeView
from gateway.routing.costmodel import prefill_seconds
from gateway.vocab import Role
from prefixgate.v1 import node_pb2, node_pb2_grpc

log = structlog.get_logger("prefixgate.nodes")

ROLES = ("prefill", "decode", "monolithic")
_ROLE = {r.value: r for r in Role}
MIN_TIMED_PREFILL_S = 0.005
SLOWNESS_DEADBAND = 1.5
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 0),
]


@dataclass(eq=False)
class Node:
    """One node as this gateway knows it."""

    role: str
    address: str
    channel: grpc.aio.Channel
    stub: node_pb2_grpc.NodeStub
    health: health_pb2_grpc.HealthStub
    node_id: str = ""
    stats: node_pb2.NodeStats | None = None
    stats_at: float = 0.0
    reachable: bool = False
    draining: bool = False
    instance_id: str = ""
    # This gateway's own in-flight work on the node.
    local_requests: int = 0
    local_tokens: int = 0
    active_streams: int = 0
    consecutive_failures: int = 0
    mispredictions: int = 0
    last_error: str = ""
    serving: bool = True
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    # Observed / estimated prefill time (EWMA): a node slower than it claims gets less traffic.
    slowness: float = 1.0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.node_id or self.address

    @property
    def routable(self) -> bool:
        return (
            self.reachable
            and self.serving
            and not self.draining
            and self.stats is not None
            and self.breaker.allows(time.monotonic())
        )

    @property
    def healthy(self) -> bool:
        return self.reachable and self.serving and self.breaker.state == "closed"

    def observe_prefill(self, estimated_s: float, observed_s: float, alpha: float = 0.3) -> None:
        """Learn how much slower (or faster) the node is than its profile claims.

        Prefills too short to time well (scheduler jitter dominates) teach nothing.
        """
        if estimated_s < MIN_TIMED_PREFILL_S or observed_s <= 0:
            return
        ratio = min(100.0, max(0.1, observed_s / estimated_s))
        self.slowness = (1 - alpha) * self.slowness + alpha * ratio

    @property
    def speed_factor(self) -> float:
        """The learned slowness, with a dead band so equal nodes with noisy timings stay equal."""
        s = self.slowness
        return s if s > SLOWNESS_DEADBAND or s < 1 / SLOWNESS_DEADBAND else 1.0

    @property
    def capacity_blocks(self) -> int:
        return self.stats.capacity_blocks if self.stats is not None else 0

    def profile_prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        """Prefill time the node's own profile predicts (before learned slowness)."""
        prof = self.stats.profile if self.stats is not None else None
        if prof is None or prof.prefill_tokens_per_s <= 0:
            return 0.0
        return prefill_seconds(prof.prefill_tokens_per_s, prof.attention_coeff_s, new_tokens, context_tokens)

    def view(self) -> NodeView:
        st = self.stats
        remote_tokens = 0
        remote_reqs = 0
        streams = self.active_streams
        if st is not None:
            # Work queued on the node by other gateways (ours is counted locally).
            remote_tokens = max(0, int(st.queued_tokens) - self.local_tokens)
            queued = int(st.queued_requests + st.running_requests)
            remote_reqs = max(0, queued - self.local_requests)
            streams += max(0, queued - self.active_streams)
        prof = st.profile if st is not None else None
        fmt = st.kv_format if st is not None else None
        return NodeView(
            node_id=self.id,
            outstanding_requests=self.local_requests + remote_reqs,
            outstanding_tokens=self.local_tokens + remote_tokens,
            prefill_tokens_per_s=(
                prof.prefill_tokens_per_s / self.speed_factor
                if prof and prof.prefill_tokens_per_s > 0
                else 1e9
            ),
            attention_coeff_s=(prof.attention_coeff_s * self.speed_factor) if prof else 0.0,
            transfer_bytes_per_s=prof.transfer_bytes_per_s if prof else 0.0,
            kv_bytes_per_token=fmt.bytes_per_token if fmt else 0,
            capacity_blocks=self.capacity_blocks,
            routable=self.routable,
            role=_ROLE[self.role],
            kv_format=KVFormat(
                fmt.model_fingerprint, fmt.block_size, fmt.dtype, fmt.layout, fmt.bytes_per_token
            )
            if fmt is not None
            else None,
            streams=streams,
            used_blocks=st.used_blocks if st is not None else 0,
        )


class NodePool:
    """Every node of every role; keeps stats fresh and tells who can take work."""

    def __init__(self, stats_interval_s: float = 0.5) -> None:
        self.nodes: dict[str, Node] = {}  # by address
        self.stats_interval_s = stats_interval_s
        self._closed = False
        self.on_node_ready: list[object] = []

    def add(self, role: str, address: str) -> Node:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if address in self.nodes:
            raise ValueError(f"node {address} is already registered")
        channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        node = Node(
            role=role,
            address=address,
            channel=channel,
            stub=node_pb2_grpc.NodeStub(channel),
            health=health_pb2_grpc.HealthStub(channel),
        )
        self.nodes[address] = node
        if not self._closed:
            node.tasks.append(asyncio.create_task(self._poll(node), name=f"stats:{address}"))
        return node

    def extend(self, role: str, addresses: Iterable[str]) -> None:
        for a in addresses:
            self.add(role, a)

    async def remove(self, address: str) -> Node | None:
        node = self.nodes.pop(address, None)
        if node is not None:
            await self._stop_node(node)
        return node

    def by_id(self, node_id: str) -> Node | None:
        for n in self.nodes.values():
            if n.id == node_id or n.address == node_id:
                return n
        return None

    def role(self, role: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.role == role]

    def routable(self, role: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.role == role and n.routable]

    async def refresh(self, node: Node, timeout: float = 2.0) -> bool:
        try:
            st = await node.stub.Stats(node_pb2.StatsRequest(), timeout=timeout)
        except (TimeoutError, grpc.aio.AioRpcError) as e:
            if node.reachable:
                log.warning("node_unreachable", node=node.id, address=node.address, error=str(e)[:200])
            node.reachable = False
            node.last_error = str(e)[:500]
            return False
        if not node.reachable:
            log.info("node_reachable", node=st.node_id or node.address, address=node.address, role=st.role)
        node.stats = st
        node.stats_at = time.monotonic()
        node.node_id = st.node_id or node.address
        node.instance_id = st.instance_id
        node.reachable = True
        return True

    async def _poll(self, node: Node) -> None:
        while not self._closed:
            await self.refresh(node)
            await asyncio.sleep(self.stats_interval_s)

    async def wait_ready(self, timeout: float = 10.0) -> bool:
        """Until every node answered once (or the timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(n.stats is not None for n in self.nodes.values()):
                return True
            await asyncio.sleep(0.05)
        return False

    async def _stop_node(self, node: Node) -> None:
        for t in node.tasks:
            t.cancel()
        for t in node.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        node.tasks.clear()
        await node.channel.close()

    async def close(self) -> None:
        self._closed = True
        for node in list(self.nodes.values()):
            await self._stop_node(node)
