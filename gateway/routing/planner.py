"""The whole routing decision for one request, from node views alone.

``plan`` decides how a request is served and by whom: the mode (split over a prefill/decode pair,
monolithic, or a fallback to monolithic), the prefill node (the policy's choice), the decode node
(the least busy one that accepts the prefill node's KV pages), the monolithic node (in case the
request is not split) and the reason for each. The live gateway builds views of its nodes and
calls it; the trace simulator builds views of its simulated nodes and calls it too, so both make
the same decision on the same views.

The queue-wait estimate that triggers the TTFT-budget fallback is computed here, from the chosen
prefill node's view (outstanding prefill tokens / throughput), so the fallback works the same
whatever the policy, and when prefix routing is switched off.

Pure: no I/O, no clock, no state. The tie-break ``turn`` is the caller's decision count; a
preview passes the turn the next real decision will get and changes nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from prefixgate.gateway.records import record
from prefixgate.gateway.routing.base import Decision, NodeView, Policy, RouteInput
from prefixgate.gateway.routing.least_loaded import LeastLoadedPolicy
from prefixgate.gateway.routing.mode import ModeDecision, choose_mode
from prefixgate.gateway.vocab import Mode, Role

# The policy that routes when prefix routing is switched off: it ignores the cache.
WITHOUT_PREFIX_ROUTING: Policy = LeastLoadedPolicy()


@record
class RequestView:
    """A request as the router sees it."""

    prompt_tokens: int
    block_size: int
    hits: Mapping[str, int]  # node -> leading blocks held
    first_block: int = 0  # hash of the first block (0 when the prompt is shorter than a block)
    # The context a node generating the request must hold: the prompt and the room its max_tokens
    # needs (``gateway.core.context.needed``); 0: routed whatever the nodes' contexts.
    context_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        """The context a prefill node must hold: the prompt and its first token."""
        return min(self.context_tokens, self.prompt_tokens + 1)


@record
class Rules:
    """The switches and limits that shape a plan (the gateway's settings, the simulator's config)."""

    disaggregation: bool = True
    prefix_routing: bool = True
    min_disagg_tokens: int = 0  # serve monolithic below this many uncached tokens
    ttft_budget_s: float = 30.0  # fall back when the estimated prefill queue wait exceeds it


DEFAULT_RULES = Rules()


@dataclass(frozen=True, slots=True)
class Plan:
    """How a request is served and why.

    ``prefill`` is the policy's prefill choice whenever a prefill node is routable (shown by
    explain even when the request is not split); ``decode_node`` is set only when split, and
    ``monolithic`` only when not. ``queue_wait_s`` is the estimated prefill queue wait on the
    chosen prefill node (0 without one).
    """

    mode: ModeDecision
    hits: Mapping[str, int]
    prefill: Decision | None = None
    decode_node: str | None = None
    monolithic: Decision | None = None
    queue_wait_s: float = 0.0


def queue_wait_s(node: NodeView) -> float:
    """Seconds of prefill queued on ``node`` ahead of a new request (policy-independent)."""
    return node.outstanding_tokens / node.prefill_tokens_per_s if node.prefill_tokens_per_s > 0 else 0.0


def one_link(views: Sequence[NodeView]) -> list[NodeView]:
    """The prefill candidates priced on one link: the slowest any of them reports.

    The KV a request ships is the same whichever node computes it, but the link rates nodes report
    mix measurements (nodes that already shipped pages) with modelled figures (nodes that have not
    yet). Left as they are, the node that served before — the one holding the prefix — looks slower
    to ship from than a cold node and loses its own cache hit. One figure for all keeps the transfer
    in every estimate (and so in the TTFT budget) without letting it pick between candidates.
    """
    rates = [v.transfer_bytes_per_s for v in views if v.transfer_bytes_per_s > 0]
    if len(views) < 2 or not rates:
        return list(views)
    link = min(rates)
    return [v if v.transfer_bytes_per_s == link else replace(v, transfer_bytes_per_s=link) for v in views]


def _candidates(
    nodes: Sequence[NodeView], role: Role, exclude: Collection[str], tokens: int = 0
) -> list[NodeView]:
    """Routable nodes of ``role`` whose context holds ``tokens`` (0: any), but ``exclude``."""
    return [
        v for v in nodes if v.role == role and v.routable and v.node_id not in exclude and v.holds(tokens)
    ]


def decode_candidates(
    nodes: Sequence[NodeView], exclude: Collection[str] = (), tokens: int = 0
) -> list[NodeView]:
    """Routable decode nodes whose context holds ``tokens``, least busy first (streams, then a node
    awaiting its breaker's trial, then KV blocks in use, then id).

    A half-open node among equally idle ones goes first: taken in id order it would get its one
    trial only when its peers are busy, and under light traffic a node back from a restart would
    stay out of rotation for good."""
    return sorted(
        _candidates(nodes, Role.DECODE, exclude, tokens),
        key=lambda v: (v.streams, not v.trial, v.used_blocks, v.node_id),
    )


def serving_model(nodes: Sequence[NodeView]) -> str | None:
    """The model the prefill pool serves (None when no prefill node has reported one)."""
    for v in nodes:
        if v.role == Role.PREFILL and v.kv_format is not None and v.kv_format.model_fingerprint:
            return v.kv_format.model_fingerprint
    return None


def monolithic_candidates(
    nodes: Sequence[NodeView], exclude: Collection[str] = (), tokens: int = 0
) -> list[NodeView]:
    """Nodes that may serve the whole request (their context holding ``tokens``): the monolithic
    pool, else the decode nodes, never one running another model than the prefill pool (it would
    answer wrongly)."""
    model = serving_model(nodes)

    def same_model(v: NodeView) -> bool:
        return model is None or v.kv_format is None or v.kv_format.model_fingerprint == model

    mono = [v for v in _candidates(nodes, Role.MONOLITHIC, exclude, tokens) if same_model(v)]
    return mono or [v for v in _candidates(nodes, Role.DECODE, exclude, tokens) if same_model(v)]


def choose(
    policy: Policy,
    rules: Rules,
    request: RequestView,
    candidates: Sequence[NodeView],
    *,
    transfer: bool,
    turn: int = 0,
) -> Decision:
    """One policy decision over ``candidates`` (the cache-blind policy when prefix routing is off)."""
    chosen_policy = policy if rules.prefix_routing else WITHOUT_PREFIX_ROUTING
    inp = RouteInput(
        prompt_tokens=request.prompt_tokens,
        block_size=request.block_size,
        hits=request.hits,
        first_block=request.first_block,
        transfer=transfer,
        turn=turn,
    )
    return chosen_policy.choose(inp, candidates)


def pair(prefill: NodeView, decode: Sequence[NodeView]) -> tuple[list[NodeView], str]:
    """The decode nodes that accept ``prefill``'s KV pages (identical format), and why others not.

    A prefill node whose format is unknown is paired with every decode node (the decode node
    refuses pages it cannot take, and the request is retried elsewhere).
    """
    fmt = prefill.kv_format
    if fmt is None:
        return list(decode), ""
    accepting = [d for d in decode if d.kv_format == fmt]
    refused = "; ".join(f"{d.node_id}: {fmt.mismatch(d.kv_format)}" for d in decode if d.kv_format != fmt)
    return accepting, refused


def plan(
    request: RequestView,
    nodes: Sequence[NodeView],
    policy: Policy,
    rules: Rules = DEFAULT_RULES,
    *,
    exclude: Collection[str] = (),
    turn: int = 0,
) -> Plan:
    """Which mode, which nodes, and why, for ``request`` over ``nodes`` (every node of every role,
    routable or not; ``exclude`` names nodes that already failed this request). Only nodes whose
    context holds the request are candidates (``RequestView.context_tokens``)."""
    prefill = one_link(_candidates(nodes, Role.PREFILL, exclude, request.prefill_tokens))
    decode = decode_candidates(nodes, exclude, request.context_tokens)
    mono_candidates = monolithic_candidates(nodes, exclude, request.context_tokens)
    decision: Decision | None = None
    chosen: NodeView | None = None
    if prefill:
        decision = choose(policy, rules, request, prefill, transfer=True, turn=turn)
        chosen = next((v for v in prefill if v.node_id == decision.node_id), None)
    wait = queue_wait_s(chosen) if chosen is not None else 0.0
    mono = (
        choose(policy, rules, request, mono_candidates, transfer=False, turn=turn)
        if mono_candidates
        else None
    )
    mode = choose_mode(
        disaggregation=rules.disaggregation,
        prefill_configured=any(v.role == Role.PREFILL for v in nodes),
        prefill_routable=len(prefill),
        decode_routable=len(decode) + len(_candidates(nodes, Role.MONOLITHIC, (), request.context_tokens)),
        uncached_tokens=request.prompt_tokens - (mono.cached_blocks * request.block_size if mono else 0),
        min_disagg_tokens=rules.min_disagg_tokens,
        queue_wait_s=wait,
        ttft_budget_s=rules.ttft_budget_s,
    )
    if mode.mode != Mode.DISAGGREGATED:
        return Plan(mode, request.hits, decision, None, mono, wait)
    if chosen is None:  # a policy answered a node it was not offered
        mode = ModeDecision(Mode.FALLBACK, "the policy chose no prefill node")
        return Plan(mode, request.hits, decision, None, mono, wait)
    accepting, refused = pair(chosen, decode)
    if not accepting:
        why = f"no decode node accepts the prefill node's KV pages ({refused})" if decode else ""
        mode = ModeDecision(Mode.FALLBACK, why or "no decode node can take the request")
        return Plan(mode, request.hits, decision, None, mono, wait)
    return Plan(mode, request.hits, decision, accepting[0].node_id, None, wait)
