"""The gateway-held queue, live: a request no node can start now waits here for its turn.

Each model's pool has one ``scheduling.Scheduler`` (pure: the order, the bounds, the verdicts);
``Gate`` runs it on the event loop. ``enter`` is awaited by the executor after the index lookup
and before the plan: it returns at once when a node has room and nothing waits, else the
request waits until ``pump`` gives it its turn: whenever a node's prefill load falls (an
attempt's prefill is over, on this gateway) and, while anything waits, every
``PUMP_INTERVAL_S`` (load other gateways put on the nodes, nodes coming back). A request given
its turn is planned at once (late binding: fresh hits and load), and counts as a provisional
slot until the plan has put its load on a node (``started``), so one freed slot starts one
request.

Refusals: the queue's bounds (``full``), a sheddable request whose TTFT target the predicted
wait already misses (``shed``), a wait past ``scheduler_max_wait_s`` (``expired``): all 429
with ``Retry-After``. A late request that is not sheddable is served whole (fallback) when a
node serving whole requests would give its first token sooner than the queue, else it waits.
A client that leaves while waiting takes its request out of the queue.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Sequence

import structlog

from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.errors import Overloaded
from prefixgate.gateway.core.request import Prepared
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.records import record
from prefixgate.gateway.routing.base import NodeView
from prefixgate.gateway.scheduling.classes import (
    DEFAULT_SCHEDULE,
    Schedule,
    class_table,
    schedule_of,
    unknown_class,
)
from prefixgate.gateway.scheduling.queue import Entry, QueueLimits
from prefixgate.gateway.scheduling.room import RoomRule, has_room
from prefixgate.gateway.scheduling.scheduler import Admit, Scheduler, Verdict, pool_rate, prefill_views

log = structlog.get_logger("prefixgate.pipeline")

PUMP_INTERVAL_S = 0.05


@record
class Turn:
    """A request's passage through the gate."""

    model: str = ""
    schedule: Schedule = DEFAULT_SCHEDULE
    waited_s: float = 0.0
    granted: bool = False  # it held a provisional slot: ``started`` gives it back
    whole: str = ""  # served whole instead of waiting, and why ("": not so)
    admit: Admit | None = None


NO_WAIT = Turn()


def limits_of(s: Settings) -> QueueLimits:
    return QueueLimits(
        max_requests=s.scheduler_queue_requests,
        max_bytes=s.scheduler_queue_bytes,
        max_wait_s=s.scheduler_max_wait_s,
        quantum_tokens=s.scheduler_quantum_tokens,
        shortest_first=s.scheduler_shortest_first,
        max_defer_s=s.scheduler_max_defer_s,
        promote_after_s=s.scheduler_promote_after_s,
    )


class Gate:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        serving: Callable[[str], list[Node]],
        disaggregation: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.serving = serving  # the nodes of a model's pools
        self.disaggregation = disaggregation
        self.classes = class_table(settings.priority_classes)
        self.limits = limits_of(settings)
        self.room = RoomRule(settings.scheduler_window_s, settings.scheduler_node_requests)
        self.schedulers: dict[str, Scheduler] = {}
        self._waiters: dict[int, asyncio.Future[bool]] = {}
        self._granted: dict[str, int] = {}
        self._tickets = itertools.count(1)
        self._ticker: asyncio.Task[None] | None = None
        self._depth_labels: set[tuple[str, str]] = set()

    def schedule(self, prep: Prepared) -> Schedule:
        """The request's class, priority and target; a 400 for a class not configured."""
        ctx = prep.context
        bad = unknown_class(self.classes, ctx.priority_class)
        if bad is not None:
            raise bad
        body = prep.priority if prep.priority_given else None  # the client's ``priority``
        return schedule_of(self.classes, ctx.priority_class or None, body, ctx.ttft_slo_ms)

    def views(self, model: str, of: Sequence[NodeView] | None = None) -> list[NodeView]:
        """The views of the nodes that compute ``model``'s prompts (among ``of``, the views of
        every node serving it, when the caller has them)."""
        views = [n.view() for n in self.serving(model)] if of is None else list(of)
        if not self.disaggregation():
            views = [v for v in views if v.role != "prefill"]
        return prefill_views(views)

    def _scheduler(self, model: str) -> Scheduler:
        s = self.schedulers.get(model)
        if s is None:
            s = self.schedulers[model] = Scheduler(self.limits, self.room)
        return s

    def _free(self, model: str, views: Sequence[NodeView]) -> int:
        """Nodes with room, less the requests given a turn and not yet planned (no routable node:
        every waiting request goes, to be refused by the planner)."""
        if not views:
            return len(self._scheduler(model).queue)
        return sum(1 for v in views if has_room(v, self.room)) - self._granted.get(model, 0)

    def _blocked(self, model: str, views: Sequence[NodeView]) -> bool:
        """The nodes' room is taken by requests given their turn and not yet planned (only then
        is it counted here: otherwise ``Scheduler.arrive`` looks at the room itself, once)."""
        return bool(self._granted.get(model)) and self._free(model, views) <= 0

    def entry(
        self, prep: Prepared, schedule: Schedule, hits: dict[str, int], views: Sequence[NodeView]
    ) -> Entry:
        best = max(hits.values(), default=0) * self.settings.block_size
        cost = max(1, prep.prompt_tokens - min(best, prep.prompt_tokens))
        rate = pool_rate(views)
        per_node = rate / len(views) if views and rate > 0 else 0.0
        predicted = cost / per_node if per_node > 0 else 0.0
        return Entry(
            next(self._tickets), prep.tenant, schedule, cost, predicted, time.monotonic(), len(prep.tokens)
        )

    def preview(self, prep: Prepared, hits: dict[str, int]) -> Admit:
        """What ``enter`` would decide for ``prep`` now, changing nothing (explain)."""
        sched = self._scheduler(prep.model)
        if not sched.on:
            return Admit(Verdict.START)
        views = self.views(prep.model)
        e = self.entry(prep, self.schedule(prep), hits, views)
        return sched.arrive(e, views, e.arrival_s, blocked=self._blocked(prep.model, views))

    async def enter(
        self,
        prep: Prepared,
        hits: dict[str, int],
        deadline: float,
        whole_ttft_s: Callable[[], float | None],
        views: Sequence[NodeView] | None = None,
    ) -> Turn:
        """Wait for ``prep``'s turn (at once when a node has room and nothing waits); raises
        Overloaded when refused. ``whole_ttft_s``: the first-token time a node serving whole
        requests predicts for it (None: there is none), for a late request; ``views``: those of
        every node serving the model, taken since the last await."""
        model = prep.model
        schedule = self.schedule(prep)
        sched = self._scheduler(model)
        if not sched.on:
            return Turn(model, schedule)
        views = self.views(model, views)
        e = self.entry(prep, schedule, hits, views)
        admit = sched.arrive(e, views, e.arrival_s, blocked=self._blocked(model, views))
        verdict = admit.verdict
        if verdict == Verdict.START:
            return Turn(model, schedule, admit=admit)
        if verdict in (Verdict.FULL, Verdict.SHED):
            raise self._refused(verdict.value, schedule, admit.reason, admit.retry_after_s)
        if verdict == Verdict.LATE:
            whole = whole_ttft_s()
            if whole is not None and whole < admit.wait_s + e.predicted_s:
                return Turn(
                    model, schedule, whole=f"scheduler: {admit.reason}; served whole sooner", admit=admit
                )
        full = sched.hold(e)
        if full:
            raise self._refused("full", schedule, full, max(1.0, admit.wait_s))
        for victim in sched.displaced:  # made room for it: refused (``WaitQueue.displace``)
            waiter = self._waiters.get(victim.ticket)
            if waiter is not None and not waiter.done():
                waiter.set_result(False)
        sched.displaced.clear()
        return await self._wait(sched, e, model, schedule, deadline, admit)

    async def _wait(
        self, sched: Scheduler, e: Entry, model: str, schedule: Schedule, deadline: float, admit: Admit
    ) -> Turn:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()  # False: displaced
        self._waiters[e.ticket] = fut
        self._ensure_ticker()
        budget = min(self.limits.max_wait_s, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout=max(0.0, budget))
        except TimeoutError:
            if not fut.done():
                sched.queue.remove(e.ticket)
                why = (
                    f"it waited {self.limits.max_wait_s:g} s in the gateway's queue (scheduler_max_wait_s) "
                    "and no node could start it"
                )
                raise self._refused("expired", schedule, why, max(1.0, admit.wait_s)) from None
        except BaseException:  # cancelled: its client left
            if fut.done() and fut.result():
                self.started(model)  # it had its turn: give the slot to the next
            else:
                sched.queue.remove(e.ticket)
            raise
        finally:
            self._waiters.pop(e.ticket, None)
        if not fut.result():
            why = (
                f"the gateway's queue is full (scheduler_queue_requests={self.limits.max_requests}, "
                f"scheduler_queue_bytes={self.limits.max_bytes}) and tenant {e.tenant!r} holds the most of it"
            )
            raise self._refused("full", schedule, why, max(1.0, admit.wait_s))
        waited = time.monotonic() - e.arrival_s
        self.metrics.child(self.metrics.queue_wait, schedule.class_name).observe(waited)
        return Turn(model, schedule, waited, granted=True, admit=admit)

    def _refused(self, reason: str, schedule: Schedule, why: str, retry_after: float) -> Overloaded:
        self.metrics.queue_refused.labels(reason, schedule.class_name).inc()
        codes = {"full": "queue_full", "shed": "ttft_target_unreachable", "expired": "queue_timeout"}
        return Overloaded(
            f"not scheduled: {why}; retry later", code=codes[reason], retry_after=math.ceil(retry_after)
        )

    def started(self, model: str) -> None:
        """A request given its turn has been planned (its load is on a node now), or is gone:
        its provisional slot is free."""
        n = self._granted.get(model, 0)
        if n > 0:
            self._granted[model] = n - 1
        asyncio.get_running_loop().call_soon(self.pump, model)

    def freeing(self, model: str) -> _Freeing:
        """Around a request's load on a node: when it is lifted, the waiting get their turn."""
        return _Freeing(self, model)

    def pump_soon(self, model: str) -> None:
        """Pump ``model``'s queue on the loop's next turn, if anything waits there."""
        sched = self.schedulers.get(model)
        if sched is not None and len(sched.queue):
            asyncio.get_running_loop().call_soon(self.pump, model)

    def pump(self, model: str | None = None) -> None:
        """Give waiting requests their turn while nodes have room (every model's when None)."""
        for m in [model] if model is not None else list(self.schedulers):
            sched = self.schedulers.get(m)
            if sched is None or len(sched.queue) == 0:
                continue
            now = time.monotonic()
            views = self.views(m)
            while self._free(m, views) > 0:
                e = sched.take(views, now)
                if e is None:
                    break
                fut = self._waiters.get(e.ticket)
                if fut is None or fut.done():
                    continue
                fut.set_result(True)
                self._granted[m] = self._granted.get(m, 0) + 1

    def first_token(self, turn: Turn, started_at: float) -> None:
        """The request's first token is in: count a missed TTFT target."""
        slo = turn.schedule.ttft_slo_s
        if slo > 0 and time.monotonic() - started_at > slo:
            self.metrics.child(self.metrics.deadline_misses, turn.schedule.class_name).inc()

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="prefixgate-scheduler")

    async def _tick(self) -> None:
        """While anything waits: pump every ``PUMP_INTERVAL_S`` (load from elsewhere, nodes back)."""
        while any(len(s.queue) for s in self.schedulers.values()):
            self._set_depth()
            await asyncio.sleep(PUMP_INTERVAL_S)
            self.pump()
        self._set_depth()

    def _set_depth(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for sched in self.schedulers.values():
            for e in sched.queue:
                k = (e.schedule.class_name, e.tenant)
                counts[k] = counts.get(k, 0) + 1
        for k in self._depth_labels - counts.keys():
            self.metrics.queue_depth.labels(*k).set(0)
        for k, n in counts.items():
            self.metrics.queue_depth.labels(*k).set(n)
        self._depth_labels |= counts.keys()

    def waiting(self) -> int:
        return sum(len(s.queue) for s in self.schedulers.values())

    async def close(self) -> None:
        """Stop the ticker; waiting requests are refused by their own deadlines or shutdown."""
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)


class _Freeing:
    """``Gate.freeing``: a class, not a generator's context manager, as every attempt takes one."""

    __slots__ = ("_gate", "_model")

    def __init__(self, gate: Gate, model: str) -> None:
        self._gate, self._model = gate, model

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        self._gate.pump_soon(self._model)
