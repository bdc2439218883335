"""Cache operations behind the admin API and prefill-as-a-service: explain, evict, warm/pin.

``explain`` is read-only (it runs ``Pipeline.preview``); ``evict`` removes blocks from the
node caches (node ``Evict``) and from the index; ``warm`` prefills a prompt on nodes without
generating (node ``Prefill`` with ``skip_first_token``), optionally pinning it, and records
the blocks in the index. They return typed values; the HTTP layer (``gateway.httpfront.admin``)
parses the requests and shapes the answers' JSON.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import structlog

from prefixgate.cachetier.index import StoreOp
from prefixgate.cachetier.tokenizer import Tokenizer
from prefixgate.gateway.cluster.nodes import ROLES, Node
from prefixgate.gateway.core import keepwarm
from prefixgate.gateway.core.errors import InvalidRequest, NotFound, Overloaded, Unavailable
from prefixgate.gateway.core.request import Prepared, Switches
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.nodeclient import NodeFailure, Prompt
from prefixgate.gateway.routing import Decision, RouteInput, estimate_ttft
from prefixgate.gateway.routing.base import Estimate
from prefixgate.gateway.routing.planner import Plan
from prefixgate.gateway.vocab import FailureKind, Mode
from prefixgate.openai.normalize import Layout
from prefixgate.openai.schema import Sampling

log = structlog.get_logger("prefixgate.cache")

MAX_PIN_SECONDS = 7 * 24 * 3600.0
NODE_RPC_TIMEOUT_S = 10.0


# -- explain -------------------------------------------------------------------------------------


def cache_view(node: Node) -> str:
    """How the index knows the node's cache: from its KV events, or from routing alone."""
    return "kv-events" if node.client.capabilities.kv_events else "index-only"


@dataclass(frozen=True, slots=True)
class PromptBasis:
    """What a prompt's block hashes are computed on (``prompt_basis``)."""

    tokenizer: str
    rendering: str  # "model template" or "gateway"
    exact: bool
    approximate_for: list[str]
    exact_for: list[str]
    note: str


def prompt_basis(svc: GatewayService, prep: Prepared) -> PromptBasis:
    """What the block hashes are computed on, and whether that is what the nodes compute.

    Nodes fed tokens compute exactly the gateway's tokens. OpenAI-compatible HTTP workers take
    the request and apply their own chat template and tokenizer, so for them the hashes (the
    gateway's tokenizer over the gateway's rendering) are a declared approximation: consistent
    from request to request, so shared prefixes still meet on one worker, but not their blocks.
    """
    nodes = svc.pool.serving(prep.model, svc.settings.model)
    http = sorted(n.id for n in nodes if n.client.capabilities.openai_body)
    tokens = sorted(n.id for n in nodes if not n.client.capabilities.openai_body)
    exact = not http
    # chats through the model's own template when the gateway has it (gateway.tokens), else ours
    tokenizer = svc.pipeline.tokenizer_for(prep.model)
    model_template = getattr(tokenizer, "template", None) is not None
    return PromptBasis(
        tokenizer=tokenizer.name,
        rendering="model template" if model_template else "gateway",
        exact=exact,
        approximate_for=http,
        exact_for=tokens,
        note=(
            "block hashes are the gateway's tokens of its rendering, which the nodes compute"
            if exact
            else "block hashes are the gateway's tokenizer over its own rendering; OpenAI-compatible "
            "workers render and tokenize themselves, so for them this approximates the prompt's "
            "prefix structure (their index entries come from routing, not from their cache)"
        ),
    )


def routed(plan: Plan) -> Decision | None:
    """The decision naming the node that computes the prompt: prefill when split, else monolithic."""
    return plan.prefill if plan.mode.mode == Mode.DISAGGREGATED else plan.monolithic


def token_spans(layout: Layout, tokenizer: Tokenizer, prompt_tokens: int) -> list[tuple[int, int]]:
    """Each segment's [start, end) in tokens: contiguous, non-overlapping, covering the prompt.

    Segments are byte ranges of the rendered text. With ``bytes4`` (and token-id prompts) a token
    straddling a boundary belongs to the segment it ends in; other tokenizers are asked how many
    tokens the text before each boundary makes.
    """
    if not layout.segments:
        return []
    if not layout.text or tokenizer.name == "bytes4":

        def before(offset: int) -> int:
            return offset // 4

    else:
        raw = layout.encoded()
        cache: dict[int, int] = {}

        def before(offset: int) -> int:
            if offset not in cache:
                text = raw[:offset].decode("utf-8", errors="ignore")
                cache[offset] = len(tokenizer.encode(text)) // 4
            return cache[offset]

    bounds = [min(prompt_tokens, before(s.start)) for s in layout.segments] + [prompt_tokens]
    return [(bounds[i], max(bounds[i], bounds[i + 1])) for i in range(len(layout.segments))]


@dataclass(frozen=True, slots=True)
class NodeMatch:
    """One serving node as ``explain`` sees it: its cached prefix, load and estimate."""

    id: str
    role: str
    routable: bool
    cache: str  # ``cache_view``
    hit_blocks: int
    cached_tokens: int
    outstanding_requests: int
    outstanding_tokens: int
    active_streams: int
    estimate: Estimate | None
    chosen_for: list[str]  # "prefill", "decode", "monolithic"
    max_context_tokens: int = 0  # the node's context (0: it does not say)
    holds: bool = True  # its context holds the request (``gateway.core.context``)


@dataclass(frozen=True, slots=True)
class SegmentMatch:
    """One layout segment: its token and block range, and how much of it is cached."""

    kind: str
    label: str
    tokens: tuple[int, int]  # [start, end)
    blocks: tuple[int, int]  # [first, end)
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """Where the request would be served now, and why."""

    mode: str
    reason: str
    prefill_node: str | None
    decode_node: str | None
    monolithic_node: str | None
    node_reason: str
    cached_blocks: int
    predicted_cached_tokens: int


@dataclass(frozen=True, slots=True)
class Explanation:
    """How a request would be served now (``explain``)."""

    prep: Prepared
    block_size: int
    switches: Switches  # a copy, as they were
    segments: list[SegmentMatch]
    basis: PromptBasis
    nodes: list[NodeMatch]
    decision: RouteChoice
    scheduler: SchedulerView | None = None


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """Where the request would wait (``gateway.core.queueing``) and why."""

    verdict: str  # start, wait, full, shed, late
    priority_class: str
    priority: int
    ttft_slo_ms: float  # 0: no target
    predicted_wait_ms: float
    waiting: int  # requests waiting for the model's nodes now
    reason: str


def _node_rows(svc: GatewayService, prep: Prepared, plan: Plan) -> list[NodeMatch]:
    bs = svc.settings.block_size
    policy_estimates: dict[str, Estimate] = {}
    for d in (plan.prefill, plan.monolithic):
        if d is not None:
            policy_estimates.update({e.node_id: e for e in d.estimates})
    target, split = routed(plan), plan.mode.mode == Mode.DISAGGREGATED
    rows: list[NodeMatch] = []
    serving = svc.pool.serving(prep.model, svc.settings.model)  # other models' nodes never serve it
    need = svc.pipeline.planner.needed(prep)
    prefill = prep.prompt_tokens + 1  # a prefill node's context holds the prompt and one token
    for node in sorted(serving, key=lambda n: (ROLES.index(n.role), n.id)):
        hit = plan.hits.get(node.id, 0)
        est = policy_estimates.get(node.id)
        if est is None:  # not a candidate of this plan: the same estimate, outside the policy
            inp = RouteInput(prep.prompt_tokens, bs, plan.hits, transfer=node.role == "prefill")
            est = estimate_ttft(node.view(), inp)
        chosen = []
        if target is not None and target.node_id == node.id:
            chosen.append("prefill" if split else "monolithic")
        if split and plan.decode_node == node.id:
            chosen.append("decode")
        view = node.view()
        rows.append(
            NodeMatch(
                id=node.id,
                role=node.role,
                routable=node.routable,
                cache=cache_view(node),
                hit_blocks=hit,
                cached_tokens=min(prep.prompt_tokens, hit * bs),
                outstanding_requests=view.outstanding_requests,
                outstanding_tokens=view.outstanding_tokens,
                active_streams=node.active_streams,
                estimate=est,
                chosen_for=chosen,
                max_context_tokens=node.max_context_tokens,
                holds=need is not None and view.holds(min(need, prefill) if node.role == "prefill" else need),
            )
        )
    return rows


async def explain(svc: GatewayService, prep: Prepared) -> Explanation:
    """How this request would be served now: layout, blocks, per-node match and estimate, decision."""
    pipe = svc.pipeline
    bs = svc.settings.block_size
    hits = await pipe.lookup(prep)
    plan = pipe.preview(prep, hits)
    if not svc.pipeline.switches.prefix_routing and prep.hashes:
        # Routing ignores the index; still show what it holds.
        shown = await svc.index.lookup(prep.hashes)
        plan = replace(plan, hits=shown)
    spans = token_spans(prep.layout, svc.pipeline.tokenizer_for(prep.model), prep.prompt_tokens)
    full = len(prep.hashes)
    target = routed(plan)
    split = plan.mode.mode == Mode.DISAGGREGATED
    target_hit = target.cached_blocks if target is not None else 0
    cached_upto = min(prep.prompt_tokens, target_hit * bs)
    segments = []
    for seg, (start, end) in zip(prep.layout.segments, spans, strict=True):
        segments.append(
            SegmentMatch(
                kind=seg.kind,
                label=seg.label,
                tokens=(start, end),
                blocks=(min(full, start // bs), min(full, -(-end // bs))),
                cached_tokens=max(0, min(end, cached_upto) - start),
            )
        )
    decision = RouteChoice(
        mode=plan.mode.mode,
        reason=plan.mode.reason,
        prefill_node=target.node_id if split and target is not None else None,
        decode_node=plan.decode_node if split else None,
        monolithic_node=target.node_id if not split and target is not None else None,
        node_reason=target.reason if target is not None else "no routable node",
        cached_blocks=target_hit,
        predicted_cached_tokens=cached_upto,
    )
    return Explanation(
        prep=prep,
        block_size=bs,
        switches=replace(pipe.switches),
        segments=segments,
        basis=prompt_basis(svc, prep),
        nodes=_node_rows(svc, prep, plan),
        decision=decision,
        scheduler=_scheduler_view(svc, prep, hits),
    )


def _scheduler_view(svc: GatewayService, prep: Prepared, hits: dict[str, int]) -> SchedulerView:
    gate = svc.pipeline.gate
    admit = gate.preview(prep, hits)
    schedule = gate.schedule(prep)
    sched = gate.schedulers.get(prep.model)
    why = {
        "start": "a node has room and nothing waits: it would start at once",
        "wait": "no node has room, or others wait: it would wait its turn in the gateway",
    }
    return SchedulerView(
        verdict=admit.verdict.value,
        priority_class=schedule.class_name,
        priority=schedule.priority,
        ttft_slo_ms=round(schedule.ttft_slo_s * 1000, 3),
        predicted_wait_ms=round(admit.wait_s * 1000, 3),
        waiting=len(sched.queue) if sched is not None else 0,
        reason=admit.reason or why.get(admit.verdict.value, ""),
    )


# -- evict ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class NodeEviction:
    node: str
    evicted: list[int] = field(default_factory=list)
    index_removed: int = 0
    error: str | None = None
    # What was done where: "node and index" (the node evicted the blocks), "whole-node flush"
    # (a node that can only flush its whole cache was asked for everything), "index only".
    action: str = "node and index"


async def _evict_node(
    svc: GatewayService, node: Node, hashes: Sequence[int], everything: bool
) -> NodeEviction:
    out = NodeEviction(node.id)
    can = node.client.capabilities
    if not can.evict and can.flush and everything:
        out.action = "whole-node flush"
        keepwarm.keeper(svc).drop_node(node.id)  # a flush on purpose ends the node's keep-warm pins
        try:
            await node.client.evict((), everything=True, timeout=NODE_RPC_TIMEOUT_S)
        except NodeFailure as e:
            out.error = f"{e.kind}: {e.detail}"
    elif not can.evict:
        out.action = "index only"
        out.error = (
            "the node's protocol cannot evict single blocks (only its whole cache, with 'all')"
            if can.flush
            else "the node's protocol cannot evict blocks"
        )
    else:
        try:
            out.evicted = await node.client.evict(hashes, everything=everything, timeout=NODE_RPC_TIMEOUT_S)
        except NodeFailure as e:
            out.error = f"{e.kind}: {e.detail}"
    # The index forgets them even when the node could not be reached: stale hits cost more.
    if everything:
        out.index_removed = await svc.index.clear_node(node.id)
        svc.pipeline.inflight_prefixes.forget(node.id)
    else:
        gone = set(hashes) | set(out.evicted)
        out.index_removed = await svc.index.remove(node.id, gone)
        svc.pipeline.inflight_prefixes.forget(node.id, gone)  # nor a prefix just routed there
    svc.metrics.evicted_blocks.labels(node.id).inc(len(out.evicted))
    return out


async def evict(
    svc: GatewayService, nodes: Sequence[Node], hashes: Sequence[int], everything: bool
) -> list[NodeEviction]:
    """Evict ``hashes`` (each with every block descending from it) or everything, on ``nodes``."""
    results = await asyncio.gather(*(_evict_node(svc, n, hashes, everything) for n in nodes))
    log.info(
        "cache_evicted",
        nodes=[r.node for r in results],
        requested=len(hashes),
        all=everything,
        evicted=sum(len(r.evicted) for r in results),
    )
    return list(results)


# -- warm and pin --------------------------------------------------------------------------------


@dataclass(slots=True)
class WarmResult:
    node: str
    method: str = "prefill"  # "prefill" (computed what was missing) or "pin" (all already there)
    # How the node was warmed or pinned: "prefill" / "pin" (the node's own Prefill and Pin),
    # "re-prefill" (a one-token request: the protocol has no Prefill), "keep-warm" (a pin on a
    # node that cannot pin: re-prefilled before its LRU would drop it, ``gateway.core.keepwarm``).
    action: str = "prefill"
    cached_tokens: int = 0
    computed_tokens: int = 0
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    blocks: int = 0
    pinned_blocks: int = 0
    pinned_until: float | None = None  # unix time
    error: str | None = None
    code: str | None = None


@dataclass(frozen=True, slots=True)
class WarmReport:
    """A warm (and pin) of one prompt: what each target node did."""

    prep: Prepared
    block_size: int
    pin_seconds: float
    nodes: list[WarmResult]


def warm_targets(
    svc: GatewayService, plan: Plan, nodes: list[str] | int | None, model: str | None = None
) -> list[Node]:
    """The nodes to warm: named ones, or the ``nodes`` best (the routed node first, then the
    other routable nodes of its role by cached blocks, then load)."""
    pool = svc.pool
    if isinstance(nodes, list):
        out: list[Node] = []
        for i, name in enumerate(nodes):
            node = pool.by_id(name)
            if node is None:
                raise NotFound(f"no node {name!r}", param=f"nodes[{i}]", code="node_not_found")
            if node not in out:
                out.append(node)
        return out
    count = 1 if nodes is None else nodes
    decision = routed(plan)
    first = pool.by_id(decision.node_id) if decision is not None and decision.node_id else None
    if first is None:
        raise Unavailable("no node can take the prompt now", retry_after=2)
    serving = set(pool.serving(model, svc.settings.model)) if model is not None else None
    others = [n for n in pool.routable(first.role) if n is not first and (serving is None or n in serving)]
    others.sort(key=lambda n: (-plan.hits.get(n.id, 0), n.view().outstanding_requests, n.id))
    return [first, *others][:count]


async def _warm_node(
    svc: GatewayService, prep: Prepared, node: Node, held_blocks: int, pin_seconds: float
) -> WarmResult:
    bs = svc.settings.block_size
    res = WarmResult(node.id, blocks=len(prep.hashes))
    can = node.client.capabilities
    if not can.warm or (pin_seconds > 0 and not can.pin):
        if can.openai_body:  # it takes the OpenAI request, not our tokens: nothing to re-send
            res.error, res.code = "the node's protocol cannot warm or pin a prompt", FailureKind.INVALID.value
            svc.metrics.warm.labels(node.id, "failed").inc()
            return res
        return await _keep_warm_node(svc, prep, node, res, pin_seconds, held_blocks)
    res.action = "pin" if pin_seconds > 0 else "prefill"
    try:
        if pin_seconds > 0 and prep.hashes and held_blocks >= len(prep.hashes):
            _pinned, missing = await node.client.pin(
                prep.hashes, seconds=pin_seconds, timeout=NODE_RPC_TIMEOUT_S
            )
            if missing == 0:
                res.method = "pin"
                res.cached_tokens = len(prep.hashes) * bs
                res.computed_tokens = 0
        if res.method != "pin":
            uncached = max(0, prep.prompt_tokens - held_blocks * bs)
            with node.load(uncached):
                report = await node.client.warm(
                    Prompt(
                        f"{prep.request_id}-{node.id}",
                        prep.tokens,
                        prep.hashes,
                        Sampling(max_tokens=1),
                        priority=prep.priority,
                    ),
                    pin_seconds=pin_seconds,
                    timeout=svc.settings.request_timeout_s,
                )
            res.cached_tokens = report.cached_tokens
            res.computed_tokens = prep.prompt_tokens - report.cached_tokens
            res.queue_seconds = report.queue_s
            res.prefill_seconds = report.prefill_s
    except NodeFailure as e:
        res.error, res.code = e.detail or e.kind.value, e.kind.value
        svc.metrics.warm.labels(node.id, "failed").inc()
        return res
    if pin_seconds > 0:
        res.pinned_blocks = len(prep.hashes)
        res.pinned_until = round(time.time() + pin_seconds, 3)
    if prep.hashes:
        await svc.index.store([StoreOp(node.id, tuple(prep.hashes))])
    await svc.pool.refresh(node)  # pinned/used blocks show at once in the admin views
    svc.metrics.warm.labels(node.id, "pinned" if pin_seconds > 0 else "warmed").inc()
    return res


async def _keep_warm_node(
    svc: GatewayService, prep: Prepared, node: Node, res: WarmResult, pin_seconds: float, held_blocks: int
) -> WarmResult:
    """Warm with a one-token request; a pin keeps re-sending it (``gateway.core.keepwarm``). The
    tenant is told of no more reuse than its own prefixes on the node account for
    (``held_blocks``, per the index) when the engine's cache is shared between tenants."""
    res.method = res.action = "keep-warm" if pin_seconds > 0 else "re-prefill"
    try:
        t0 = time.monotonic()
        pair = keepwarm.partner(svc, node)
        with node.load(0):
            r = await keepwarm.reprefill(
                node, prep.tokens, tuple(prep.hashes), svc.settings.request_timeout_s, pair
            )
        res.prefill_seconds = round(time.monotonic() - t0, 6)
        own = min(prep.prompt_tokens, held_blocks * svc.settings.block_size)
        isolates = node.client.capabilities.tenant_salt
        cached = svc.pipeline.tenancy.reported_cached(r.cached_tokens, own, isolates)
        res.cached_tokens = cached
        res.computed_tokens = prep.prompt_tokens - cached
        if pin_seconds > 0:
            until = keepwarm.keeper(svc).add(node, prep.tokens, tuple(prep.hashes), pin_seconds)
            res.pinned_blocks = len(prep.hashes)
            res.pinned_until = round(until, 3)
    except (NodeFailure, Overloaded) as e:
        if isinstance(e, NodeFailure):
            res.error, res.code = e.detail or e.kind.value, e.kind.value
        else:
            res.error, res.code = e.message, FailureKind.OVERLOADED.value
        svc.metrics.warm.labels(node.id, "failed").inc()
        return res
    if prep.hashes:
        await svc.index.store([StoreOp(node.id, tuple(prep.hashes))])
    svc.metrics.warm.labels(node.id, "pinned" if pin_seconds > 0 else "warmed").inc()
    return res


async def warm(
    svc: GatewayService,
    prep: Prepared,
    nodes: list[str] | int | None,
    pin_seconds: float,
    *,
    tenant_quota: bool = False,
) -> WarmReport:
    """Prefill ``prep`` on the target nodes (no generation), pinned for ``pin_seconds`` if > 0.

    With ``tenant_quota`` (a tenant's own pin, not an admin's) the pin is first reserved against
    the tenant's pin quota (``gateway.state.quotas``), and given back on the nodes where it failed.
    Raises ``Overloaded`` when every node was full, ``Unavailable`` when none could take it.
    """
    if not 0 <= pin_seconds <= MAX_PIN_SECONDS:
        raise InvalidRequest(
            f"'pin_seconds' must be between 0 and {MAX_PIN_SECONDS:.0f}", param="pin_seconds"
        )
    hits = await svc.index.lookup(prep.hashes) if prep.hashes else {}
    plan = svc.pipeline.preview(prep, hits)
    targets = warm_targets(svc, plan, nodes, prep.model)
    hold = None
    if tenant_quota:
        capacities = {n.id: n.status.capacity_blocks if n.status else 0 for n in targets}
        hold = await svc.pins.reserve(prep.tenant, capacities, prep.hashes, pin_seconds)
    try:
        results = await asyncio.gather(
            *(_warm_node(svc, prep, n, hits.get(n.id, 0), pin_seconds) for n in targets)
        )
    except BaseException:
        if hold is not None:
            await asyncio.shield(svc.pins.cancel_all(hold))
        raise
    if hold is not None:
        for r in results:
            if r.error:
                await svc.pins.cancel(hold, r.node)
    for r in results:  # the tenant's account: what the engines computed or found cached
        if not r.error:
            svc.usage.record(prep.tenant, prep.model, r.cached_tokens + r.computed_tokens, r.cached_tokens, 0)
    log.info(
        "cache_warmed",
        nodes=[r.node for r in results],
        prompt_tokens=prep.prompt_tokens,
        pin_seconds=pin_seconds,
        failed=[r.node for r in results if r.error],
    )
    failed = [r for r in results if r.error]
    if failed and len(failed) == len(results):
        detail = "; ".join(f"{r.node}: {r.error}" for r in failed)
        if all(r.code == FailureKind.OVERLOADED for r in failed):
            raise Overloaded(f"no node had room for the prompt ({detail})", retry_after=1)
        raise Unavailable(f"no node could take the prompt ({detail})", retry_after=2)
    return WarmReport(prep, svc.settings.block_size, pin_seconds, list(results))


@dataclass(frozen=True, slots=True)
class Warm:
    """The runner's job (``gateway.core.runner.Job``) of a warm: the prompt on ``nodes`` (named,
    a count of the best, or None: the routed one), pinned for ``pin_seconds`` if > 0."""

    svc: GatewayService
    nodes: list[str] | int | None
    pin_seconds: float
    tenant_quota: bool = False

    async def start(self, prepared: Prepared) -> WarmReport:
        return await warm(self.svc, prepared, self.nodes, self.pin_seconds, tenant_quota=self.tenant_quota)

    async def close(self, started: WarmReport) -> None:
        """Nothing to close: the warm is done once started."""
