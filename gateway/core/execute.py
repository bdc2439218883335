"""Running a request: attempts on the planned nodes, retries elsewhere, the fallback to serving whole.

The split path is tried on the best prefill/decode pair, then on the next best after each
failure (the node at fault excluded); when it cannot serve, the request falls back to
monolithic serving, itself tried on other nodes. Both are one attempt loop over their own
choice of nodes: at most ``retry_max_attempts`` a path, with backoff between attempts, all
within the request's deadline. Once the first token is out, a failure is not retried: the
generation migrates, a continuation executed here again (``gateway.core.migration``).

An attempt's prefill (split; served whole, its first token) has the time the gateway predicts for
it on its node, with a margin (``routing.deadline``): a hung node costs a short request seconds
while a long prefill keeps the time it needs; every first token within ``first_token_timeout_s``.
It also watches the ``Node.gone`` spells of its nodes: one declared gone (its breaker
opened: failed probes, failed requests) while the attempt still needs it ends the attempt at
once, retried like any failure (``FailureKind.GONE``).

A decode that fails after its prefill was done is retried on the same prefill node when it can
take it (with another decode node): that node now holds the prompt's prefix, so the retry's
prefill is a cache hit instead of the whole prompt computed again elsewhere.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import cast

import structlog

from prefixgate.gateway import tracing
from prefixgate.gateway.cluster.breaker import OPEN
from prefixgate.gateway.cluster.nodes import Node, NodePool, Spell
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core import context, migration
from prefixgate.gateway.core.accounting import Accounting
from prefixgate.gateway.core.errors import Overloaded, Unavailable
from prefixgate.gateway.core.execution import Execution
from prefixgate.gateway.core.features import unable
from prefixgate.gateway.core.plan import Lookup, Planner, Snapshot, decision_notes
from prefixgate.gateway.core.queueing import NO_WAIT, Gate
from prefixgate.gateway.core.refusals import engine_words, refusal, too_long
from prefixgate.gateway.core.request import Failure, Prepared, Timings
from prefixgate.gateway.core.tenancy import Tenancy
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.nodeclient import (
    NodeFailure,
    OpenAIBody,
    PrefillWatched,
    Prompt,
    StageTimings,
    TokenDelta,
    TokenStream,
)
from prefixgate.gateway.nodeclient.openai_body import for_choice
from prefixgate.gateway.records import record
from prefixgate.gateway.routing import Decision, costmodel, deadline
from prefixgate.gateway.routing.mode import ModeDecision
from prefixgate.gateway.routing.planner import Plan
from prefixgate.gateway.toolcalls.support import passing_through
from prefixgate.gateway.vocab import FailureKind, Mode, Role, Stage
from prefixgate.openai.features import Feature

log = structlog.get_logger("prefixgate.pipeline")


def backoff_s(attempt: int, s: Settings) -> float:
    """The pause before attempt number ``attempt`` (0-based): none before the first, then
    ``retry_backoff_initial_s`` times ``retry_backoff_multiplier`` per attempt, at most
    ``retry_backoff_max_s``, scaled by a random factor within ``retry_jitter_factor`` of 1 and
    plus up to ``retry_jitter_s``."""
    if attempt == 0:
        return 0.0
    delay = s.retry_backoff_initial_s * s.retry_backoff_multiplier ** (attempt - 1)
    delay = min(s.retry_backoff_max_s, delay)
    if s.retry_jitter_factor:
        delay *= 1.0 + random.uniform(-s.retry_jitter_factor, s.retry_jitter_factor)
    return delay + (random.uniform(0, s.retry_jitter_s) if s.retry_jitter_s else 0.0)


def _not_for_monolithic(e: NodeFailure) -> bool:
    """A prefill node that failed may still serve whole requests; a node that failed to decode may
    not, unless all it refused was pages in another format."""
    decoding = e.stage in (Stage.DECODE, Stage.TRANSFER, Stage.GENERATE)
    return decoding and e.kind != FailureKind.FORMAT_REFUSED


def _worth_retrying(e: NodeFailure) -> bool:
    """A failure another node may not repeat: a retryable kind, or a refusal for length (a
    node with a larger context may serve the request)."""
    return e.kind.retryable or too_long(e)


async def _first_delta(stream: TokenStream) -> TokenDelta:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise NodeFailure("", Stage.GENERATE, FailureKind.INTERNAL, "stream ended before any token") from None


async def _first_unless_gone(
    stream: TokenStream, t: Target, spells: dict[Node, Spell], until: Callable[[bool], float]
) -> TokenDelta:
    """The stream's first delta, unless a node it still needs is declared gone first, or
    ``until`` (the monotonic time by which it must come, given whether the prefill has reported)
    passes: TimeoutError then. The attempt fails (``abandoned``) as soon as a node it needs is
    declared gone, or already is (its breaker opened while the attempt waited to start).

    The delta is awaited in the request's own task; a timer and the nodes' spells (``spells``,
    taken when the attempt began) cancel that wait, and the cancellation becomes the failure. A
    task for the delta and one for each node's event cost more than the rest of the attempt's
    bookkeeping. The caller closes the stream, which ends its legs by their abort rule."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    gone = {n for n in t.nodes if n.breaker.state == OPEN or spells[n].ended}
    why: list[BaseException] = []  # what ended the wait: the failure raised instead of the cancel

    def stop(reason: BaseException) -> None:
        if not why:
            why.append(reason)
            task.cancel()

    def check() -> None:
        failure = abandoned(t, gone, stream.prefill is not None)
        if failure is not None:
            stop(failure)

    def departed(node: Node) -> Callable[[], None]:
        def note() -> None:
            gone.add(node)
            check()

        return note

    timer: asyncio.TimerHandle | None = None

    def due() -> None:
        nonlocal timer
        left = until(stream.prefill is not None) - time.monotonic()
        if left <= 0:
            timer = None
            stop(TimeoutError())
        else:  # the prefill reported meanwhile: the first token's own deadline now
            timer = loop.call_later(left, due)

    failure = abandoned(t, gone, stream.prefill is not None)
    if failure is not None:
        raise failure
    left = until(stream.prefill is not None) - time.monotonic()
    if left <= 0:
        raise TimeoutError
    cancelling = task.cancelling()
    unwatch = [spell.watch(departed(node)) for node, spell in spells.items()]
    timer = loop.call_later(left, due)
    try:
        return await _first_delta(stream)
    except asyncio.CancelledError:
        if why and task.uncancel() <= cancelling:
            raise why[0] from None
        raise  # cancelled from outside (client gone, shutdown)
    except BaseException:
        if why and task.cancelling() > cancelling:  # the stream turned our cancel into an error
            task.uncancel()
        raise
    finally:
        if timer is not None:
            timer.cancel()
        for stop_watching in unwatch:
            stop_watching()


def _blamed(e: NodeFailure, nodes: tuple[Node, ...]) -> Node:
    """The node a failure names (the last one given when it names none of them)."""
    for n in nodes:
        if e.node_id in (n.client.address, n.address, n.id):
            return n
    return nodes[-1]


def _prompt(prep: Prepared, node: Node, generating: Node | None = None) -> Prompt:
    """The prompt for ``node``; with the OpenAI request when the node generates from it. The
    gateway's default ``max_tokens`` is lowered to the room left in the context of the node that
    generates (``generating``, default ``node``; ``gateway.core.context.room``)."""
    sampling = prep.sampling
    contexts = [(generating or node).max_context_tokens]
    limit = context.room(prep.prompt_tokens, sampling.max_tokens, bool(prep.max_tokens_param), contexts)
    if limit != sampling.max_tokens:
        sampling = replace(sampling, max_tokens=limit)
    openai = None
    if node.client.capabilities.openai_body and prep.openai_body is not None:
        openai = for_choice(prep.openai_body(), sampling.seed, sampling.choice)
        if limit != prep.sampling.max_tokens:
            openai = OpenAIBody(openai.kind, {**openai.body, "max_tokens": limit})
    return Prompt(
        prep.request_id,
        prep.tokens,
        prep.hashes,
        sampling,
        openai,
        prep.engine_salt,
        prep.resumed,
        prep.priority,
    )


def abandoned(t: Target, gone: Collection[Node], prefill_reported: bool) -> NodeFailure | None:
    """The failure of an attempt on ``t`` once ``gone`` are declared gone, if it still needs one of
    them: the prefill node until its leg has reported, the node that streams until the first
    token. None: it waits on (a prefill node gone after its part was done is no loss)."""
    if t.prefill is not None and t.prefill in gone and not prefill_reported:
        at, stage = t.prefill, Stage.PREFILL
    elif t.decode in gone:
        at, stage = t.decode, (Stage.DECODE if t.prefill is not None else Stage.GENERATE)
    else:
        return None
    return NodeFailure(at.id, stage, FailureKind.GONE, "node declared gone before the first token")


@record
class Target:
    """The nodes one attempt tries (a prefill node on the split path) and the decision that
    picked the node computing the prompt."""

    prefill: Node | None
    decode: Node
    decision: Decision
    route: str
    reason: str

    @property
    def nodes(self) -> tuple[Node, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)


@dataclass(slots=True)
class Run:
    """One request being executed: what its attempts share and what they leave behind."""

    prep: Prepared
    lookup: Lookup
    deadline: float  # loop-independent monotonic time
    failures: list[Failure] = field(default_factory=list)
    attempts: int = 0
    # The lookup's and the decisions', and the attempts ended by a node declared gone (request log).
    notes: dict[str, int] = field(default_factory=dict)


# What the next attempt would try, its nodes chosen once the backoff pause is over; None:
# nothing left to try.
NextTarget = Callable[[], Callable[[], Target | None] | None]


class Executor:
    def __init__(
        self,
        settings: Settings,
        pool: NodePool,
        planner: Planner,
        accounting: Accounting,
        metrics: Metrics,
        tenancy: Tenancy,
        gate: Gate,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.planner = planner
        self.accounting = accounting
        self.metrics = metrics
        self.tenancy = tenancy
        self.gate = gate

    async def execute(
        self,
        prep: Prepared,
        *,
        exclude: Collection[str] = (),
        deadline: float | None = None,
        continuing: bool = False,
    ) -> Execution:
        """Route and start the request; raises Overloaded or Unavailable when no node can serve it.
        ``exclude``, ``deadline``, ``continuing``: a migration's (``gateway.core.migration``); a
        continuation that cannot start is not a request failed of its own (the request it
        continues is counted when it ends)."""
        if deadline is None:
            deadline = time.monotonic() + self.settings.request_timeout_s
        need = self.planner.need(prep)  # 400 when no node's context holds it
        unserved = unable(self.pool.nodes.values(), prep.needs) | set(exclude)  # 400: no node can
        if prep.tool_parser:  # the gateway parses the tool calls: not for pass-through workers
            unserved |= passing_through(self.pool.nodes.values())
        found = await self.planner.lookup(prep)
        snap: Snapshot | None = self.planner.snapshot(prep.model)  # until something awaits
        turn = NO_WAIT
        if not continuing:  # a continuation's request had its turn: its output is half sent
            turn = await self.gate.enter(
                prep,
                found.hits,
                deadline,
                lambda: self._whole_ttft_s(prep, found, unserved, need, snap),
                snap.views if snap is not None else None,
            )
            if turn.granted:  # it waited for its turn: the nodes have changed since
                snap = None
        if turn.schedule.priority != prep.priority:  # the class's priority reaches the engines
            prep = replace(prep, priority=turn.schedule.priority)
        try:
            if turn.waited_s > 0:  # late binding: what the index holds now
                found = await self.planner.lookup(prep)
            run = Run(prep, found, deadline, notes={**found.notes, "retries_node_gone": 0})
            if turn.waited_s > 0:
                run.notes["scheduler_wait_ms"] = round(turn.waited_s * 1000)
            hits = found.hits
            plan = self.planner.decide(prep, hits, set(unserved), snap)
            if turn.whole and plan.mode.mode == Mode.DISAGGREGATED:
                plan = replace(plan, mode=ModeDecision(Mode.FALLBACK, turn.whole))
        finally:
            if turn.granted:
                self.gate.started(turn.model)
        started_at = time.monotonic()
        ex = await self._execute_plan(prep, run, plan, hits, unserved, need, continuing, snap)
        self.gate.first_token(turn, started_at - turn.waited_s)
        return ex

    def _whole_ttft_s(
        self, prep: Prepared, found: Lookup, unserved: set[str], need: int, snap: Snapshot | None
    ) -> float | None:
        """The first-token time the best node serving whole requests predicts for ``prep``
        (None: no such node): what a late request weighs against waiting."""
        candidates = self.planner.monolithic_candidates(unserved, prep.model, need, snap)
        if not candidates:
            return None
        chosen = self.planner.choose(prep, found.hits, candidates).chosen
        return None if chosen is None else chosen.queue_s + chosen.prefill_s

    async def _execute_plan(
        self,
        prep: Prepared,
        run: Run,
        plan: Plan,
        hits: dict[str, int],
        unserved: set[str],
        need: int,
        continuing: bool,
        snap: Snapshot | None = None,
    ) -> Execution:
        """The attempts of ``plan``: split, then whole (``execute``). ``snap``: the nodes as
        ``plan`` saw them, nothing having awaited since."""

        if plan.mode.mode == Mode.DISAGGREGATED:
            excluded: set[str] = set(unserved)

            def split() -> Callable[[], Target | None] | None:
                pnode = self.pool.by_id(plan.prefill.node_id or "") if plan.prefill else None
                dnode = self.pool.by_id(plan.decode_node or "")
                if plan.mode.mode != Mode.DISAGGREGATED or pnode is None or dnode is None:
                    return None
                assert plan.prefill is not None
                target = Target(pnode, dnode, plan.prefill, Mode.DISAGGREGATED, plan.mode.reason)
                return lambda: target

            def replan() -> None:
                nonlocal plan, hits
                kept = run.failures[-1].prefilled_on
                if kept is not None:  # its prefill was done: that node holds the prefix now
                    hits = {**hits, kept.id: len(prep.hashes)}
                    others = {n.id for n in self.pool.role(Role.PREFILL) if n is not kept}
                    plan = self.planner.decide(prep, hits, excluded | others)
                    if plan.mode.mode == Mode.DISAGGREGATED:
                        return
                plan = self.planner.decide(prep, hits, excluded)

            ex = await self._attempts(run, split, excluded, replan)
            if ex is not None:
                return ex

        failures = run.failures
        if failures:
            route, reason = (
                Mode.FALLBACK,
                "split pipeline failed: " + "; ".join(str(f) for f in failures[-3:]),
            )
            self.metrics.fallbacks.labels("split_failed").inc()
        elif plan.mode.mode == Mode.FALLBACK:
            route, reason = Mode.FALLBACK, plan.mode.reason
            self.metrics.fallbacks.labels("unavailable").inc()
        else:
            route, reason = Mode.MONOLITHIC, plan.mode.reason

        if all(_worth_retrying(f.error) for f in failures):
            excluded = {f.node.id for f in failures if _not_for_monolithic(f.error)} | unserved

            # the first whole attempt, with no split tried before it, starts before anything
            # awaits: the nodes are as the plan saw them
            fresh = snap if plan.mode.mode != Mode.DISAGGREGATED else None

            def whole() -> Callable[[], Target | None] | None:
                nonlocal fresh
                taken, fresh = fresh, None
                candidates = self.planner.monolithic_candidates(excluded, prep.model, need, taken)
                if not candidates:
                    return None
                # the plan chose among these very candidates, by the same views: its choice stands
                planned = plan.monolithic if taken is not None else None

                def pick() -> Target | None:
                    decision = planned or self.planner.choose(prep, hits, candidates)
                    node = self.pool.by_id(decision.node_id or "")
                    return None if node is None else Target(None, node, decision, route, reason)

                return pick

            ex = await self._attempts(run, whole, excluded)
            if ex is not None:
                return ex

        if not continuing:
            self.metrics.requests.labels(route, "failed").inc()
        last = failures[-1].error if failures else None
        if last is not None and too_long(last) and context.largest(self.planner.contexts(prep.model)):
            raise self.planner.exceeded(prep, engine_words(last))  # no node left whose context holds it
        refused = refusal(failures[-1].error, prep.needs.get(Feature.RESPONSE_FORMAT)) if failures else None
        if refused is not None:  # the engine judged the client's own request: its answer is a 400 (422)
            raise refused
        if failures and all(f.error.kind == FailureKind.OVERLOADED for f in failures):
            raise Overloaded("every node is at capacity; retry shortly", retry_after=1)
        detail = "; ".join(str(f) for f in failures[-3:]) or f"no node can serve it: {plan.mode.reason}"
        kept_out = [f"{n.id} is kept out: {n.refused}" for n in self.pool.nodes.values() if n.refused]
        if not failures and kept_out:  # what the operator must change, not only that nothing served
            detail = "; ".join([detail, *kept_out[:3]])
        raise Unavailable(f"no node could serve the request ({detail})", retry_after=2)

    async def _attempts(
        self,
        run: Run,
        next_target: NextTarget,
        excluded: set[str],
        after_failure: Callable[[], None] | None = None,
    ) -> Execution | None:
        """Attempts on the nodes ``next_target`` picks, the node at fault of each failure added to
        ``excluded`` (then ``after_failure``), until one starts, a failure is not worth a retry,
        nothing is left to try or the deadline is too close. None: nothing started."""
        for attempt in range(self.settings.retry_max_attempts):
            pending = next_target()
            if pending is None or not await self._pause(attempt, run.deadline):
                return None
            if attempt:  # the nodes changed during the pause: what may be tried is found again
                pending = next_target()
                if pending is None:
                    return None
            target = pending()
            if target is None:
                return None
            run.attempts += 1
            run.notes.update(decision_notes(target.decision))
            began = time.perf_counter()
            outcome = await self._attempt(run, target)
            if isinstance(outcome, Execution):
                return outcome
            self._failed(outcome, run)
            e = outcome.error
            tracing.failed_attempt(
                began, run.attempts, outcome.node.id, e.stage.value, e.kind.value, e.detail
            )
            if not _worth_retrying(outcome.error):
                return None
            excluded.add(outcome.node.id)
            if after_failure is not None:
                after_failure()
        return None

    async def _pause(self, attempt: int, deadline: float) -> bool:
        """Back off before a retry; False when the deadline leaves no time for another attempt."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        pause = backoff_s(attempt, self.settings)
        if pause:
            await asyncio.sleep(min(pause, left))
        return time.monotonic() < deadline

    def _failed(self, f: Failure, run: Run) -> None:
        run.failures.append(f)
        self._note_failure(f)
        kind = f.error.kind
        if kind == FailureKind.GONE:
            run.notes["retries_node_gone"] += 1
        self.metrics.retries.labels(f.error.stage.value, kind.value).inc()

    def _note_failure(self, f: Failure) -> None:
        # a node declared gone has its verdict already: the attempts it ended are no more evidence
        spared = (FailureKind.OVERLOADED, FailureKind.INVALID, FailureKind.CONSTRAINT, FailureKind.GONE)
        if f.error.kind not in spared:
            f.node.breaker.on_failure(time.monotonic())
        else:
            f.node.breaker.on_release()
        f.node.last_error = str(f)[:500]
        f.node.settle()  # a breaker this failure opened lets go of the node's other attempts
        log.warning(
            "node_attempt_failed",
            node=f.node.id,
            stage=f.error.stage.value,
            kind=f.error.kind.value,
            detail=f.error.detail[:200],
        )

    async def _attempt(self, run: Run, t: Target) -> Execution | Failure:
        """One attempt, up to its first token: split across ``t.prefill`` and ``t.decode``, or
        served whole by ``t.decode``.

        The node computing the prompt carries the request's load until its prefill is done,
        on either path: between two stats polls the policy otherwise sees none of the requests
        it just sent and piles them on one node.
        """
        prep, pnode, dnode = run.prep, t.prefill, t.decode
        handoff = pnode.client.handoff if pnode is not None else None
        if pnode is not None and handoff is None:
            return Failure(pnode, NodeFailure(pnode.id, Stage.PREFILL, FailureKind.INVALID, "cannot split"))
        computing = pnode or dnode
        nodes = t.nodes
        predicted = t.decision.cached_blocks * self.settings.block_size
        uncached = max(0, prep.prompt_tokens - predicted)
        timings = Timings()
        prefill_limit = self._prefill_limit_s(run, t, uncached, prep.prompt_tokens - uncached)
        spells = {n: n.gone for n in nodes}  # taken before anything awaits: no departure is missed
        for n in nodes:
            n.breaker.on_dispatch()
        with computing.load(uncached) as lease, dnode.dispatched(), self.gate.freeing(prep.model):
            ticket, served = self.planner.hold_prefix(prep, computing), False
            timeout = max(0.01, run.deadline - time.monotonic())
            if pnode is not None and handoff is not None:
                prompt = _prompt(prep, pnode, dnode)
                stream = handoff.start(prompt, pnode.client, dnode.client, timeout=timeout)
                # the prefill node is free once it reports (an attribute check: ``isinstance``
                # against the runtime Protocol walks its members every request)
                if hasattr(stream, "on_prefill"):

                    def prefill_done() -> None:
                        lease.release()
                        self.gate.pump_soon(prep.model)

                    cast(PrefillWatched, stream).on_prefill = prefill_done
            else:
                stream = dnode.client.generate(_prompt(prep, dnode), timeout=timeout)
            try:
                first = await self._first(stream, run.deadline, t, spells, prefill_limit)
                served = True
            except NodeFailure as e:
                await stream.aclose()
                blamed = _blamed(e, nodes)
                prefilled = pnode if pnode is not None and stream.prefill is not None else None
                if e.kind == FailureKind.TIMEOUT and blamed is computing and stream.prefill is None:
                    computing.ran_past()
                for n in nodes:
                    if n is blamed:
                        continue
                    if n is prefilled:
                        n.breaker.on_success()  # the prefill node did its part; its partner failed
                    else:
                        n.breaker.on_release()  # no verdict on a node the failure was not at
                return Failure(blamed, e, prefilled if prefilled is not blamed else None)
            except BaseException:
                await stream.aclose()  # cancelled (client gone): nothing left running on the nodes
                for n in nodes:
                    n.breaker.on_release()
                raise
            finally:
                self.planner.release_prefix(ticket, served)
        for n in nodes:
            n.breaker.on_success()
        # a node stating no speed is timed here: its first-token deadlines follow what it did; a
        # whole answer's wait was the whole generation, so it times a prefill node by its leg's
        # end (the KV handed over) and a node serving it whole not at all
        computed = prep.prompt_tokens - stream.cached_tokens
        if not getattr(stream, "whole_answer", False):
            computing.in_time(computed, time.perf_counter() - timings.start)
        elif pnode is not None and stream.prefill is not None and stream.prefill.prefill_s > 0:
            computing.in_time(computed, stream.prefill.prefill_s)
        st = stream.timings
        timings.node = StageTimings(st.queue_s, st.prefill_s, st.transfer_s if pnode is not None else 0.0)
        if pnode is not None:
            report = stream.prefill
            if report is not None:
                pnode.observe_prefill(
                    pnode.profile_prefill_s(prep.prompt_tokens - report.cached_tokens, report.cached_tokens),
                    report.prefill_s,
                )
                self.metrics.transfer_bytes.inc(report.transfer_bytes)
        timings.first_token_at = time.perf_counter()
        self.accounting.record(prep, *(n.id for n in nodes))
        return Execution(
            prep,
            route=t.route,
            reason=t.reason,
            prefill_node=pnode,
            decode_node=dnode,
            stream=stream,
            first=first,
            predicted_tokens=predicted,
            timings=timings,
            attempts=run.attempts,
            on_close=self.accounting.finished,
            stall_timeout_s=self.settings.stall_timeout_s,
            cache_shared=self.tenancy.shares_cache(computing.client.capabilities.tenant_salt),
            notes=run.notes,
            index_hits=run.lookup.index_hits,
            migrate=migration.executor_hook(self, run.deadline) if self.settings.max_migrations > 0 else None,
            max_migrations=self.settings.max_migrations,
            block_size=self.settings.block_size,
        )

    def _prefill_limit_s(self, run: Run, t: Target, uncached: int, cached: int) -> float:
        """Seconds the attempt's prefill may take (``routing.deadline``): what is predicted for it
        on the node computing it, from the load there before it is counted, plus the KV's trip
        to the decode node on the split path."""
        computing = t.prefill or t.decode
        transfer = 0.0
        if t.prefill is not None:
            view = computing.view()
            transfer = costmodel.transfer_seconds(
                run.prep.prompt_tokens, view.kv_bytes_per_token, view.transfer_bytes_per_s
            )
            queued = view.outstanding_tokens
        else:  # the node's queue is all that is needed: no view of the rest
            queued = computing.outstanding_tokens()
        s = self.settings
        rule = deadline.Rule(
            s.first_token_deadline_margin, s.first_token_deadline_floor_s, s.first_token_timeout_s
        )
        work = deadline.Work(queued, uncached, cached, transfer)
        return deadline.limit_s(computing.prefill_speed, work, rule, run.deadline - time.monotonic())

    async def _first(
        self,
        stream: TokenStream,
        deadline: float,
        t: Target,
        spells: dict[Node, Spell],
        prefill_limit: float,
    ) -> TokenDelta:
        """The attempt's first delta: its prefill within ``prefill_limit`` seconds (the prediction,
        ``_prefill_limit_s``), the first delta within ``first_token_timeout_s``, both within the
        request deadline, unless a node it still needs is declared gone first (``abandoned``;
        ``spells``: the nodes' spells, taken when the attempt began). Served whole, the first
        delta is the prefill's end.

        A silent attempt is charged to the node still computing: the prefill node while its leg
        has not reported (a hung prefill is not the decode node's fault) unless the decode node
        fails its health probes meanwhile, or has missed probe rounds the prefill node answered
        (then the prefill is most likely waiting to push pages to it), else the node that should
        be streaming. The caller closes the stream, which cancels the nodes' work.
        """
        prefill_node, node = t.prefill, t.decode
        start = time.monotonic()
        cap = self.settings.first_token_timeout_s
        first_by = min(deadline, start + cap) if cap > 0 else deadline
        prefill_by = min(first_by, start + prefill_limit)
        if getattr(stream, "whole_answer", False):
            # the first delta is the whole answer: only the request's deadline bounds it, and the
            # prefill's limit only where the prefill reports apart (a split's prefill leg)
            first_by = deadline
            prefill_by = prefill_by if prefill_node is not None else deadline

        def until(prefill_reported: bool) -> float:
            return first_by if prefill_reported else prefill_by

        try:
            return await _first_unless_gone(stream, t, spells, until)
        except TimeoutError:
            limit = until(stream.prefill is not None) - start
            if (
                prefill_node is not None
                and stream.prefill is None
                and node.reachable
                and not self._quieter(node, prefill_node)
            ):
                at, stage = prefill_node, Stage.PREFILL
            elif prefill_node is not None and stream.prefill is None:
                at, stage = node, Stage.TRANSFER
            else:
                at, stage = node, (Stage.DECODE if prefill_node is not None else Stage.GENERATE)
            raise NodeFailure(at.id, stage, FailureKind.TIMEOUT, f"no first token in {limit:.3g}s") from None

    def _quieter(self, a: Node, b: Node) -> bool:
        """``a`` last answered its probe more than two probe intervals before ``b`` did (two nodes
        polled out of phase differ by less than one): it went silent first. A node whose probe
        already failed is caught by ``reachable``."""
        gap = 2 * self.pool.stats_interval_s
        return bool(a.status_at and b.status_at) and a.status_at < b.status_at - gap
