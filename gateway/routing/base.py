"""What a policy sees and what it decides."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

from prefixgate.gateway.records import record
from prefixgate.gateway.routing import costmodel
from prefixgate.gateway.vocab import Role


@dataclass(frozen=True, slots=True)
class KVFormat:
    """The layout of a node's KV pages: pages move only between nodes whose formats are equal."""

    model_fingerprint: str = ""
    block_size: int = 0
    dtype: str = ""
    layout: str = ""
    bytes_per_token: int = 0

    def mismatch(self, other: KVFormat | None) -> str:
        """Which fields differ, in the words the nodes use."""
        if other is None:
            return "KV format unknown"
        diffs = [
            f"{f.name} {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        return "KV format mismatch: " + ", ".join(diffs)


# NodeView and Estimate are records (``gateway.records``), as the request's other values: a
# request makes one of each for every node it may go to, and as frozen dataclasses the pair cost
# it 28K instructions a node more (``bench instructions``).


@record
class NodeView:
    """A node as the router sees it at decision time (all times in wall-clock seconds).

    The cost figures default to the reference ``s5000`` (``costmodel.S5000``). Not to be
    changed once made (see above).
    """

    node_id: str
    outstanding_requests: int = 0  # admitted to this node and not yet past prefill
    outstanding_tokens: int = 0  # prefill tokens still to compute for those requests
    prefill_tokens_per_s: float = costmodel.S5000.prefill_tokens_per_s
    attention_coeff_s: float = costmodel.S5000.attention_coeff_s  # s per (new token x context token)
    transfer_bytes_per_s: float = costmodel.S5000.transfer_bytes_per_s
    kv_bytes_per_token: int = 0  # 0: unknown, no transfer term
    capacity_blocks: int = 0
    routable: bool = True
    role: Role = Role.PREFILL
    kv_format: KVFormat | None = None  # None: not reported yet
    streams: int = 0  # decode/generate streams running or waiting on the node
    used_blocks: int = 0  # KV blocks in use: cached blocks nobody holds are left out
    max_context_tokens: int = 0  # the longest request the node serves (0: it does not say)
    # Its breaker is half-open: one trial request decides whether it is back (``cluster.breaker``).
    trial: bool = False

    def holds(self, tokens: int) -> bool:
        """Whether the node's context holds a request of ``tokens`` (one that does not say its
        context is taken to hold any: it refuses what it cannot serve, and is retried around)."""
        return self.max_context_tokens <= 0 or tokens <= self.max_context_tokens


@record
class RouteInput:
    prompt_tokens: int
    block_size: int
    hits: Mapping[str, int]  # node -> leading blocks held
    first_block: int = 0  # hash of the first block (0 when the prompt is shorter than a block)
    transfer: bool = True  # KV will travel to a decode node
    turn: int = 0  # the caller's decision count: policies break ties round the nodes with it


@record
class Estimate:
    """One node's estimate in a decision; not to be changed once made (see ``NodeView``)."""

    node_id: str
    hit_blocks: int
    cached_tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    load: int
    within_bound: bool

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s + self.transfer_s


@record
class Decision:
    node_id: str | None
    reason: str
    cached_blocks: int = 0
    estimates: Sequence[Estimate] = field(default_factory=tuple)

    @property
    def chosen(self) -> Estimate | None:
        for e in self.estimates:
            if e.node_id == self.node_id:
                return e
        return None


def prefill_seconds(node: NodeView, new_tokens: int, context_tokens: int) -> float:
    """Linear term plus attention over the context already cached and the new tokens."""
    return costmodel.prefill_seconds(
        node.prefill_tokens_per_s, node.attention_coeff_s, new_tokens, context_tokens
    )


def estimate_ttft(node: NodeView, inp: RouteInput, load_bound: int | None = None) -> Estimate:
    hit = min(inp.hits.get(node.node_id, 0), inp.prompt_tokens // max(1, inp.block_size))
    cached = hit * inp.block_size
    queue = node.outstanding_tokens / node.prefill_tokens_per_s
    prefill = prefill_seconds(node, inp.prompt_tokens - cached, cached)
    transfer = 0.0
    if inp.transfer:
        transfer = costmodel.transfer_seconds(
            inp.prompt_tokens, node.kv_bytes_per_token, node.transfer_bytes_per_s
        )
    within = load_bound is None or node.outstanding_requests + 1 <= load_bound
    return Estimate(node.node_id, hit, cached, queue, prefill, transfer, node.outstanding_requests, within)


class Policy(Protocol):
    name: str

    def choose(self, inp: RouteInput, nodes: Sequence[NodeView]) -> Decision:
        """Pick one of ``nodes`` (only routable ones are passed) or None when empty.

        Pure: the same input gives the same decision (ties are broken with ``inp.turn``).
        """
        ...
