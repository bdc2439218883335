"""Where a request goes: the index lookup (with prefixes routed and still computing) and the
planner's choice over the nodes' views (``gateway.routing.planner``), kept pure there.

``Planner`` holds what routing remembers between requests: the policies' tie-break turn per
model and the prefixes in flight.
"""

from __future__ import annotations

import time
from dataclasses import field

import structlog

from prefixgate.cachetier.index import BlockIndex
from prefixgate.gateway.cluster.nodes import Node, NodePool
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core import context
from prefixgate.gateway.core.errors import InvalidRequest
from prefixgate.gateway.core.request import Prepared, Switches
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.records import record
from prefixgate.gateway.routing import Decision, NodeView, Policy, RouteInput, parse_policy, planner
from prefixgate.gateway.routing.inflight import InflightPrefixes, extension, follows_inflight, merge_hits
from prefixgate.gateway.routing.planner import Plan, RequestView, Rules
from prefixgate.gateway.vocab import Role

log = structlog.get_logger("prefixgate.pipeline")

TURN_WRAP = 1 << 30  # the tie-break turn counts decisions, modulo this


@record
class Lookup:
    """What the index (and the prefixes in flight) say of a request's blocks."""

    hits: dict[str, int] = field(default_factory=dict)  # node -> leading blocks, as routing sees them
    index_hits: dict[str, int] = field(default_factory=dict)  # the index's alone
    # For the request log: the index's longest hit and how much further prefixes in flight reach.
    notes: dict[str, int] = field(default_factory=dict)


@record
class Snapshot:
    """Nodes and their views, taken together: a model's nodes, or those of them that may serve a
    request (``Planner.monolithic_candidates``). The nodes' load changes only across an await,
    so a request admitted, planned and sent on its way without one in between is weighed by one
    snapshot, not by every node viewed again at each step."""

    nodes: tuple[Node, ...] = ()
    views: tuple[NodeView, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.nodes)


def decision_notes(decision: Decision) -> dict[str, int]:
    """For the request log: when the longest hit was left on another node, whether that node
    was over the policy's load bound and how loaded it looked."""
    best = max(decision.estimates, key=lambda e: e.hit_blocks, default=None)
    if best is None or best.node_id == decision.node_id or best.hit_blocks <= decision.cached_blocks:
        return {}
    return {
        "longest_hit_over_bound": int(not best.within_bound),
        "longest_hit_load": best.load,
        "longest_hit_queue_ms": round(best.queue_s * 1000),
    }


class Planner:
    def __init__(
        self,
        settings: Settings,
        pool: NodePool,
        index: BlockIndex,
        metrics: Metrics,
        switches: Switches,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.index = index
        self.metrics = metrics
        self.switches = switches
        self.policy: Policy = parse_policy(settings.policy, {"load_factor": settings.load_factor})
        # The policies' tie-break turn, per model: each model's pools take their own turns.
        self.turns: dict[str, int] = {}
        self.inflight_prefixes = InflightPrefixes()

    async def lookup(self, prep: Prepared) -> Lookup:
        if not self.switches.prefix_routing or not prep.hashes:
            return Lookup()
        t0 = time.perf_counter()
        try:
            hits = await self.index.lookup(prep.hashes)
        except Exception as e:  # an index failure degrades routing, never the request
            log.warning("index_lookup_failed", error=repr(e)[:200], request_id=prep.request_id)
            hits = {}
        else:
            m = self.metrics
            m.child(m.index_lookup, self.index.backend).observe(time.perf_counter() - t0)
        return self._with_inflight(prep, hits)

    def _with_inflight(self, prep: Prepared, hits: dict[str, int]) -> Lookup:
        """The index's hits, extended by prefixes routed and still computing (``inflight_prefixes``)."""
        tracker = self.inflight_prefixes
        pending = tracker.hits(prep.hashes, time.monotonic())
        gain = extension(hits, pending)
        tracker.stats.lookups += 1
        tracker.stats.extended += gain > 0
        bs = self.settings.block_size
        notes = {"index_best_tokens": max(hits.values(), default=0) * bs, "inflight_gain_tokens": gain * bs}
        routed = hits
        if self.settings.inflight_prefixes and follows_inflight(self.policy):
            routed = merge_hits(hits, pending)
        return Lookup(routed, hits, notes)

    def hold_prefix(self, prep: Prepared, node: Node) -> int:
        """Hold the request's chain for ``node`` until its prefill is over (a ticket; 0: none)."""
        if not self.switches.prefix_routing:
            return 0
        return self.inflight_prefixes.add(node.id, prep.hashes, time.monotonic())

    def release_prefix(self, ticket: int, served: bool) -> None:
        self.inflight_prefixes.done(ticket, time.monotonic(), served=served)

    def _rules(self) -> Rules:
        s, sw = self.settings, self.switches
        return Rules(sw.disaggregation, sw.prefix_routing, s.min_disagg_tokens, s.ttft_budget_s)

    def serving(self, model: str) -> list[Node]:
        """The nodes serving ``model``: a request is only ever routed within its model's pools."""
        return self.pool.serving(model, self.settings.model)

    def snapshot(self, model: str) -> Snapshot:
        """The nodes serving ``model`` and their views now."""
        nodes = tuple(self.serving(model))
        return Snapshot(nodes, tuple(n.view() for n in nodes))

    def monolithic_candidates(
        self, exclude: set[str], model: str, tokens: int = 0, snap: Snapshot | None = None
    ) -> Snapshot:
        """Nodes that may serve the whole request, their context holding ``tokens``
        (``planner.monolithic_candidates``), from ``snap`` if taken since the last await."""
        snap = snap if snap is not None else self.snapshot(model)
        by_id = dict(zip((v.node_id for v in snap.views), snap.nodes, strict=True))
        views = planner.monolithic_candidates(snap.views, exclude, tokens)
        return Snapshot(tuple(by_id[v.node_id] for v in views), tuple(views))

    def contexts(self, model: str) -> list[int]:
        """The contexts of the nodes that may generate ``model``'s requests (decode and
        monolithic: a prefill node only computes the prompt), 0 for one that does not say."""
        return [n.max_context_tokens for n in self.serving(model) if n.role != Role.PREFILL]

    def needed(self, prep: Prepared) -> int | None:
        """The context a node generating ``prep`` must hold; None: no node's holds it."""
        given = bool(prep.max_tokens_param)
        return context.needed(prep.prompt_tokens, prep.sampling.max_tokens, given, self.contexts(prep.model))

    def need(self, prep: Prepared) -> int:
        """The context a node generating ``prep`` must hold (``gateway.core.context.needed``);
        raises the client's 400 naming the largest context when no node's holds it."""
        tokens = self.needed(prep)
        if tokens is None:
            raise self.exceeded(prep)
        return tokens

    def exceeded(self, prep: Prepared, engine_said: str = "") -> InvalidRequest:
        """The client's 400 for ``prep``, longer than the largest context of its model's nodes
        (``context.exceeded``; ``engine_said``: the words of a node that refused it)."""
        return context.exceeded(
            prep.prompt_tokens,
            prep.sampling.max_tokens,
            context.largest(self.contexts(prep.model)),
            prompt_param=prep.prompt_param,
            max_tokens_param=prep.max_tokens_param,
            engine_said=engine_said,
        )

    def choose(self, prep: Prepared, hits: dict[str, int], candidates: Snapshot) -> Decision:
        """The policy's node among ``candidates`` for serving the whole request (no turn taken),
        weighed by their views as found: call it before anything awaits."""
        inp = RouteInput(
            prompt_tokens=prep.prompt_tokens,
            block_size=self.settings.block_size,
            hits=hits,
            first_block=prep.hashes[0] if prep.hashes else 0,
            transfer=False,
            turn=self.turns.get(prep.model, 0),
        )
        policy = self.policy if self.switches.prefix_routing else planner.WITHOUT_PREFIX_ROUTING
        return policy.choose(inp, candidates.views)

    def _plan(
        self, prep: Prepared, hits: dict[str, int], exclude: set[str], turn: int, snap: Snapshot | None = None
    ) -> Plan:
        views = (snap if snap is not None else self.snapshot(prep.model)).views
        # a request no context holds is planned onto none (``execute`` has answered it already)
        tokens = self.needed(prep) or prep.prompt_tokens + prep.sampling.max_tokens
        request = RequestView(
            prompt_tokens=prep.prompt_tokens,
            block_size=self.settings.block_size,
            hits=hits,
            first_block=prep.hashes[0] if prep.hashes else 0,
            context_tokens=tokens,
        )
        return planner.plan(request, views, self.policy, self._rules(), exclude=exclude, turn=turn)

    def decide(
        self,
        prep: Prepared,
        hits: dict[str, int],
        exclude: set[str] | None = None,
        snap: Snapshot | None = None,
    ) -> Plan:
        """Which mode, which nodes, and why: the nodes' views (``snap``'s, if taken since the last
        await) through ``planner.plan``.

        A real decision: the model's tie-break turn moves on.
        """
        turn = self.turns.get(prep.model, 0)
        plan = self._plan(prep, hits, exclude or set(), turn, snap)
        self.turns[prep.model] = (turn + 1) % TURN_WRAP
        return plan

    def preview(self, prep: Prepared, hits: dict[str, int]) -> Plan:
        """The plan the next ``execute`` of this request would follow, changing nothing.

        The admin explain endpoint and prefill-as-a-service use this.
        """
        return self._plan(prep, hits, set(), self.turns.get(prep.model, 0))
