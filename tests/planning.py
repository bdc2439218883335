"""A gateway whose nodes reported their stats, to watch ``Pipeline.decide`` without node processes.

The nodes are registered with the pool as the gateway does it, with polling off, and each is
given the stats a node would report.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prefixgate.cachetier.hashing import block_hashes
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.pipeline import Pipeline, Prepared
from prefixgate.gateway.core.request import RequestContext
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.nodeclient import CostProfile, KVFormat, NodeStatus
from prefixgate.openai.normalize import Layout
from prefixgate.openai.schema import Sampling

BS = 64
FORMAT = dict(model_fingerprint="sim:m", block_size=BS, dtype="fp8_e4m3", layout="page", bytes_per_token=320)


def report(node: Node, node_id: str, *, queued_tokens: int = 0, dtype: str = "fp8_e4m3") -> None:
    """What a node's stats poll would have told the gateway."""
    fmt = {**FORMAT, "dtype": dtype}
    node.status = NodeStatus(
        node_id=node_id,
        role=node.role,
        kv_format=KVFormat(**fmt),  # type: ignore[arg-type]
        capacity_blocks=10_000,
        queued_requests=1 if queued_tokens else 0,
        queued_tokens=queued_tokens,
        profile=CostProfile(name="s5000", prefill_tokens_per_s=100_000.0, transfer_bytes_per_s=1e9),
    )
    node.node_id = node_id
    node.reachable = True


@asynccontextmanager
async def gateway(
    policy: str, nodes: dict[str, str], *, queued_tokens: int = 0, **settings: object
) -> AsyncIterator[Pipeline]:
    """A gateway with ``nodes`` (id -> role), each reporting ``queued_tokens`` of prefill work."""
    svc = GatewayService(Settings(policy=policy, block_size=BS, **settings), index=MemoryIndex())  # type: ignore[arg-type]
    svc.pool._closed = True  # no polling: the stats are the test's
    try:
        for port, (node_id, role) in enumerate(nodes.items(), 1):
            report(svc.pool.add(role, f"127.0.0.1:{port}"), node_id, queued_tokens=queued_tokens)
        yield svc.pipeline
    finally:
        await svc.pool.close()


def prepared(pipe: Pipeline, tokens: int = 4096) -> Prepared:
    data = pack_ids(list(range(tokens)))
    ns = pipe.namespace("m", "t")
    return Prepared(
        RequestContext("t", "r1"),
        "r1",
        ns,
        Layout(""),
        data,
        block_hashes(data, BS, ns.root()),
        Sampling(16),
        "m",
    )
