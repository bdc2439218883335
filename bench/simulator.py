"""Virtual-time replay of a workload through the gateway's routing policies.

Model (no sleeping: an event heap of arrivals and prefill completions):

- ``prefill_nodes`` nodes, each with a KV pool = one ``cachetier.memory.NodeBlocks`` of
  ``capacity_blocks / prefill_nodes`` blocks (LRU, prefix-closed, leaves evicted first). The
  pool is the ground truth; the router's view is the index ``IndexCore`` holding those very
  pools, i.e. a perfectly up-to-date index (node events applied instantly and losslessly),
  plus, as in the gateway, the prefixes routed and still queued or computing
  (``gateway.routing.inflight``; ``inflight=False`` leaves them out).
- On arrival the router looks up every node's leading hit, builds each node's ``NodeView``
  (outstanding requests, outstanding uncached prefill tokens, the cost profile) and calls the
  gateway's own planner (``gateway.routing.planner.plan``) with one idle decode node beside
  them: the policy chooses the prefill node, and the request falls back to monolithic serving
  when the chosen node's estimated queue wait (outstanding tokens / linear throughput, the
  planner's estimate, the same for every policy) exceeds ``ttft_budget_s``.
- A node serves its queue FIFO with at most ``concurrency`` requests at once sharing its
  compute equally (processor sharing; concurrency 1 = one prefill at a time). At the start
  of a prefill the node looks up its actual hit (touching those blocks); the prompt's blocks
  are stored at completion. Prefill time follows the profile's cost model.
- TTFT = queue wait + prefill (as stretched by sharing) + KV transfer of the whole prompt +
  one decode step. A fallback is served by the decode/monolithic pool, assumed to have room:
  TTFT = full prefill of the prompt with no cache + one decode step; it computes every
  prompt token and loads no prefill node.
- Busy time of a node = seconds during which it prefills; imbalance = max / mean of it.

Two ways of sending requests to the nodes (``SimConfig.scheduler``):

- **FCFS** (False, the default): every arrival is planned at once and joins its node's FIFO queue.
- **Scheduled** (True): the gateway's own ``gateway.scheduling.Scheduler`` holds what the nodes
  cannot start at once. On arrival a request becomes an ``Entry`` as the gateway builds it (its
  ``Request.tenant``; the class ``SimConfig.schedule``; cost = its uncached tokens at the best
  index hit; predicted prefill seconds = cost over one node's share of the pool's speed) and
  ``arrive`` decides over the prefill node views: START is planned and dispatched as in FCFS;
  WAIT and LATE are held; FULL and SHED are refused.
  On every arrival and every completion the requests that have waited ``max_wait_s`` are refused
  (expired) and ``take`` is called while it gives a request, each one planned at that moment
  (fresh hits and views: late binding) by the same ``plan`` call. The time in the gateway's
  queue is ``Outcome.wait_s``; it is part of ``queue_s`` and of the TTFT.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prefixgate.bench.profile import S5000, SimProfile
from prefixgate.bench.report import Outcome, PolicySummary, summarize
from prefixgate.bench.workloads import Request
from prefixgate.cachetier.memory import IndexCore, NodeBlocks
from prefixgate.gateway.routing import Policy
from prefixgate.gateway.routing.base import NodeView, prefill_seconds
from prefixgate.gateway.routing.inflight import DEFAULT_TTL_S, InflightPrefixes, follows_inflight, merge_hits
from prefixgate.gateway.routing.planner import Plan, RequestView, Rules, plan
from prefixgate.gateway.scheduling.classes import DEFAULT_SCHEDULE, Schedule
from prefixgate.gateway.scheduling.queue import DEFAULT_LIMITS, Entry, QueueLimits
from prefixgate.gateway.scheduling.room import DEFAULT_ROOM, RoomRule
from prefixgate.gateway.scheduling.scheduler import Scheduler, Verdict, pool_rate, prefill_views
from prefixgate.gateway.vocab import Mode, Role

# The decode pool, assumed to have room: it takes every split request's KV and every fallback.
DECODE_VIEW = NodeView("decode", role=Role.DECODE)


@dataclass(frozen=True, slots=True)
class SimConfig:
    prefill_nodes: int = 4
    capacity_blocks: int = 160_000  # total over the prefill nodes
    block_size: int = 64
    profile: SimProfile = S5000
    concurrency: int = 1
    ttft_budget_s: float = 30.0
    transfer: bool = True
    inflight: bool = True  # count routed, still computing prefixes as held (the gateway default)
    scheduler: bool = False  # hold what the nodes cannot start in the gateway's queue (False: FCFS)
    limits: QueueLimits = DEFAULT_LIMITS  # the queue's bounds and order (scheduled mode)
    room: RoomRule = DEFAULT_ROOM  # how little a node must hold to be given another prefill
    schedule: Schedule = DEFAULT_SCHEDULE  # every request's class: TTFT target, sheddable

    @property
    def mode(self) -> str:
        return "scheduled" if self.scheduler else "fcfs"


# Prompt bytes a waiting request holds, for the queue's byte bound: the traces' text is 4 bytes a token.
BYTES_PER_TOKEN = 4


@dataclass(slots=True)
class _Job:
    req: Request
    predicted_new: int
    ticket: int = 0  # its chain in the in-flight prefixes
    wait_s: float = 0.0  # in the gateway's queue before it was sent
    start: float = 0.0
    cached: int = 0
    new: int = 0
    work_s: float = 0.0  # prefill seconds at full speed
    remaining_s: float = 0.0  # of work_s


@dataclass(slots=True)
class _Node:
    node_id: str
    blocks: NodeBlocks
    queue: deque[_Job] = field(default_factory=deque)
    running: list[_Job] = field(default_factory=list)
    queued_tokens: int = 0
    busy_s: float = 0.0
    last_s: float = 0.0  # when running jobs' remaining work was last brought up to date
    version: int = 0  # invalidates stale completion events


class Simulator:
    """One policy, one workload, virtual time."""

    def __init__(self, policy: Policy, config: SimConfig, scheduler: Scheduler | None = None) -> None:
        self.policy = policy
        self.cfg = config
        n = config.prefill_nodes
        self.index = IndexCore(default_capacity=max(1, config.capacity_blocks // n))
        self.nodes = [_Node(f"p{i}", self.index.node(f"p{i}")) for i in range(n)]
        self.node_ids = [nd.node_id for nd in self.nodes]
        self._view = config.profile.view("_")
        self.rules = Rules(ttft_budget_s=config.ttft_budget_s)
        self._heap: list[tuple[float, int, int, int]] = []  # (time, seq, node, version)
        self._seq = 0
        self.outcomes: list[Outcome] = []
        self.now = 0.0
        self.decisions = 0
        # Tokens of the longest known hit left on another node: by the load bound, by the score.
        self.left_over_bound_tokens = 0
        self.left_by_score_tokens = 0
        follow = config.inflight and follows_inflight(policy)
        self.inflight = InflightPrefixes(ttl_s=DEFAULT_TTL_S if follow else 0.0)
        # Scheduled mode: the gateway's scheduler, the requests it holds, what it refused.
        self.scheduler: Scheduler | None = None
        if config.scheduler:
            self.scheduler = scheduler or Scheduler(config.limits, config.room)
        self.waiting: dict[int, Request] = {}
        self.refused: dict[str, int] = {"full": 0, "shed": 0, "expired": 0}
        self.refused_requests: list[int] = []
        self.started: list[int] = []  # request indices in the order they were planned

    # -- node mechanics ------------------------------------------------------------------------

    def _advance(self, nd: _Node, now: float) -> None:
        """Bring running jobs' remaining work up to ``now`` (processor sharing)."""
        if nd.running:
            done = (now - nd.last_s) / len(nd.running)
            for job in nd.running:
                job.remaining_s -= done
            nd.busy_s += now - nd.last_s
        nd.last_s = now

    def _schedule(self, nd: _Node, idx: int, now: float) -> None:
        nd.version += 1
        if nd.running:
            k = len(nd.running)
            left = min(j.remaining_s for j in nd.running)
            self._seq += 1
            heapq.heappush(self._heap, (now + max(0.0, left) * k, self._seq, idx, nd.version))

    def _start(self, nd: _Node, now: float) -> None:
        bs = self.cfg.block_size
        while nd.queue and len(nd.running) < self.cfg.concurrency:
            job = nd.queue.popleft()
            nd.queued_tokens -= job.predicted_new
            hashes = job.req.block_hashes
            hit = nd.blocks.leading(hashes)
            if hit:
                nd.blocks.touch(hashes[:hit])
            job.cached = hit * bs
            job.new = job.req.prompt_tokens - job.cached
            job.work_s = prefill_seconds(self._view, job.new, job.cached)
            job.remaining_s = job.work_s
            job.start = now
            nd.running.append(job)

    def _outstanding_tokens(self, nd: _Node) -> int:
        tokens = nd.queued_tokens
        for job in nd.running:
            if job.work_s > 0:
                tokens += int(job.new * max(0.0, job.remaining_s) / job.work_s)
        return tokens

    def _complete(self, idx: int, now: float) -> None:
        nd = self.nodes[idx]
        self._advance(nd, now)
        finished = [j for j in nd.running if j.remaining_s <= 1e-9]
        if not finished and nd.running:  # rounding: the event was for the job nearest to done
            finished = [min(nd.running, key=lambda j: j.remaining_s)]
        nd.running = [j for j in nd.running if j not in finished]
        prof = self.cfg.profile
        for job in finished:
            req = job.req
            if req.block_hashes:
                nd.blocks.store(req.block_hashes)
            self.inflight.done(job.ticket, now, served=True)
            transfer = prof.transfer_s(req.prompt_tokens) if self.cfg.transfer else 0.0
            self.outcomes.append(
                Outcome(
                    index=req.index,
                    node=nd.node_id,
                    route=Mode.DISAGGREGATED,
                    prompt_tokens=req.prompt_tokens,
                    cached_tokens=job.cached,
                    queue_s=job.start - req.arrival_s,
                    prefill_s=now - job.start,
                    transfer_s=transfer,
                    ttft_s=now - req.arrival_s + transfer + prof.first_token_s,
                    wait_s=job.wait_s,
                )
            )
        self._start(nd, now)
        self._schedule(nd, idx, now)
        self._drain(now)

    # -- routing -------------------------------------------------------------------------------

    def _views(self, now: float) -> list[NodeView]:
        prof = self.cfg.profile
        cap = self.index.default_capacity
        out: list[NodeView] = []
        for nd in self.nodes:
            self._advance(nd, now)
            out.append(
                prof.view(
                    nd.node_id,
                    len(nd.queue) + len(nd.running),
                    self._outstanding_tokens(nd),
                    cap,
                    transfer=self.cfg.transfer,
                )
            )
        return out

    def plan(self, req: Request, hits: Mapping[str, int], views: Sequence[NodeView]) -> Plan:
        """The gateway's decision for ``req`` over ``views`` (a real one: the tie-break turn moves)."""
        hashes = req.block_hashes
        request = RequestView(req.prompt_tokens, self.cfg.block_size, hits, hashes[0] if hashes else 0)
        decided = plan(request, views, self.policy, self.rules, turn=self.decisions)
        self.decisions += 1
        return decided

    def _hits(self, req: Request, now: float) -> dict[str, int]:
        hashes = req.block_hashes
        return merge_hits(self.index.lookup(hashes, self.node_ids), self.inflight.hits(hashes, now))

    def _arrive(self, req: Request, now: float) -> None:
        if self.scheduler is None:
            self._dispatch(req, now)
            return
        hits = self._hits(req, now)
        views = self._views(now)
        pool = prefill_views(views)
        entry = self._entry(req, hits, pool, now)
        admit = self.scheduler.arrive(entry, pool, now)
        if admit.verdict == Verdict.START:
            self._dispatch(req, now, hits, views)
        elif admit.verdict in (Verdict.WAIT, Verdict.LATE):
            if self.scheduler.hold(entry):
                self._refuse(req, "full")
            else:
                self.waiting[entry.ticket] = req
                for victim in self.scheduler.displaced:  # made room for it
                    self._refuse(self.waiting.pop(victim.ticket), "full")
                self.scheduler.displaced.clear()
        else:
            self._refuse(req, "shed" if admit.verdict == Verdict.SHED else "full")
        self._drain(now)

    def _entry(self, req: Request, hits: Mapping[str, int], views: Sequence[NodeView], now: float) -> Entry:
        """``req`` as the gateway's queue sees it (as ``gateway.core.queueing`` builds it): its
        uncached tokens at the best hit any node offers, over one node's share of the pool's speed."""
        best = max(hits.values(), default=0) * self.cfg.block_size
        cost = max(1, req.prompt_tokens - min(best, req.prompt_tokens))
        rate = pool_rate(views)
        per_node = rate / len(views) if views and rate > 0 else 0.0
        return Entry(
            ticket=req.index,
            tenant=req.tenant,
            schedule=self.cfg.schedule,
            cost_tokens=cost,
            predicted_s=cost / per_node if per_node > 0 else 0.0,
            arrival_s=now,
            size_bytes=req.prompt_tokens * BYTES_PER_TOKEN,
        )

    def _refuse(self, req: Request, why: str) -> None:
        self.refused[why] += 1
        self.refused_requests.append(req.index)

    def _drain(self, now: float) -> None:
        """Refuse what waited too long, then start what the nodes have room for, one at a time."""
        sched = self.scheduler
        if sched is None:
            return
        for gone in sched.expire(now):
            self._refuse(self.waiting.pop(gone.ticket), "expired")
        while self.waiting:
            entry = sched.take(prefill_views(self._views(now)), now)
            if entry is None:
                return
            self._dispatch(self.waiting.pop(entry.ticket), now)

    def _dispatch(
        self,
        req: Request,
        now: float,
        hits: Mapping[str, int] | None = None,
        views: list[NodeView] | None = None,
    ) -> None:
        """Plan ``req`` now and send it to its prefill node's queue (or serve it as a fallback)."""
        hashes = req.block_hashes
        hits = self._hits(req, now) if hits is None else hits
        views = self._views(now) if views is None else views
        self.started.append(req.index)
        wait = now - req.arrival_s
        decided = self.plan(req, hits, [*views, DECODE_VIEW])
        node_id = decided.prefill.node_id if decided.prefill is not None else None
        if decided.mode.mode != Mode.DISAGGREGATED or node_id is None:
            self._fallback(req, wait)
            return
        self._note(decided)
        idx = self.node_ids.index(node_id)
        predicted_new = req.prompt_tokens - min(hits.get(node_id, 0), len(hashes)) * self.cfg.block_size
        nd = self.nodes[idx]
        nd.queue.append(_Job(req, predicted_new, self.inflight.add(node_id, hashes, now), wait_s=wait))
        nd.queued_tokens += predicted_new
        if len(nd.running) < self.cfg.concurrency:
            self._advance(nd, now)
            self._start(nd, now)
            self._schedule(nd, idx, now)

    def _note(self, decided: Plan) -> None:
        d = decided.prefill
        best = max(d.estimates, key=lambda e: e.hit_blocks, default=None) if d is not None else None
        if d is None or best is None or best.hit_blocks <= d.cached_blocks:
            return
        lost = (best.hit_blocks - d.cached_blocks) * self.cfg.block_size
        if best.within_bound:
            self.left_by_score_tokens += lost
        else:
            self.left_over_bound_tokens += lost

    def _fallback(self, req: Request, wait_s: float = 0.0) -> None:
        prof = self.cfg.profile
        prefill = prefill_seconds(self._view, req.prompt_tokens, 0)
        self.outcomes.append(
            Outcome(
                index=req.index,
                node="",
                route=Mode.FALLBACK,
                prompt_tokens=req.prompt_tokens,
                cached_tokens=0,
                queue_s=wait_s,
                prefill_s=prefill,
                transfer_s=0.0,
                ttft_s=wait_s + prefill + prof.first_token_s,
                wait_s=wait_s,
            )
        )

    # -- the loop ------------------------------------------------------------------------------

    def run(self, requests: Sequence[Request]) -> PolicySummary:
        wall = time.perf_counter()
        heap = self._heap
        i, n = 0, len(requests)
        t0 = requests[0].arrival_s if requests else 0.0
        end = t0
        while i < n or heap:
            if heap and (i >= n or heap[0][0] <= requests[i].arrival_s):
                t, _, idx, version = heapq.heappop(heap)
                if version != self.nodes[idx].version:
                    continue  # superseded by a later schedule of that node
                self.now = end = t
                self._complete(idx, t)
            else:
                req = requests[i]
                i += 1
                self.now = max(self.now, req.arrival_s)
                self._arrive(req, self.now)
                end = max(end, self.now)
        for left in list(self.waiting.values()):  # none: idle nodes always have room
            self._refuse(left, "expired")
        self.waiting.clear()
        self.outcomes.sort(key=lambda o: o.index)
        summary = summarize(
            self.outcomes, self.node_ids, {nd.node_id: nd.busy_s for nd in self.nodes}, end - t0
        )
        summary.refused = dict(self.refused) if self.scheduler is not None else {}
        summary.wall_s = time.perf_counter() - wall
        return summary


def global_lru_bound(requests: Sequence[Request], capacity_blocks: int, block_size: int) -> dict[str, float]:
    """Hit rate of one LRU cache of the whole capacity, requests in arrival order, no latency.

    Also the hit rate of an unbounded cache (the trace's own ceiling).
    """
    lru = NodeBlocks(max(1, capacity_blocks))
    unbounded: set[int] = set()
    prompt = cached = ideal = 0
    for req in requests:
        hashes = req.block_hashes
        prompt += req.prompt_tokens
        cached += lru.leading(hashes) * block_size
        k = 0
        for h in hashes:
            if h not in unbounded:
                break
            k += 1
        ideal += k * block_size
        if hashes:
            lru.store(hashes)
            unbounded.update(hashes)
    return {
        "hit_rate": cached / prompt if prompt else 0.0,
        "unbounded_hit_rate": ideal / prompt if prompt else 0.0,
        "capacity_blocks": float(capacity_blocks),
    }


def simulate(requests: Sequence[Request], policy: Policy, config: SimConfig) -> PolicySummary:
    return Simulator(policy, config).run(requests)
