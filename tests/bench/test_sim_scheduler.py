"""The simulator's scheduled mode: the gateway's scheduler between arrivals and the nodes.

Short requests overtake long ones under overload, no request waits past the queue's bound, two
tenants share the nodes' prefill work evenly, and the simulator's starts are the scheduler's own:
the same calls replayed on a fresh ``Scheduler`` give the same verdicts and the same order.
"""

from __future__ import annotations

import io
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rich.console import Console

from prefixgate.bench import sched_table
from prefixgate.bench.report import percentile
from prefixgate.bench.simulator import SimConfig, Simulator
from prefixgate.bench.textgen import span_hashes
from prefixgate.bench.workloads import Request
from prefixgate.gateway.routing import parse_policy
from prefixgate.gateway.routing.base import NodeView
from prefixgate.gateway.scheduling.queue import Entry, QueueLimits
from prefixgate.gateway.scheduling.scheduler import Admit, Scheduler, Verdict

BS = 64
ROOT = 777
SHORT, LONG = 1_024, 32_768  # tokens: ~7 ms and ~0.3 s of prefill on s5000


def request(i: int, t: float, tokens: int, tenant: str = "") -> Request:
    spans = [(10_000 + i, tokens)]  # nothing shared: hits play no part
    return Request(i, t, tokens, tuple(span_hashes(spans, BS, ROOT)), 16, spans=tuple(spans), tenant=tenant)


def overload(n: int = 300, seed: int = 3) -> list[Request]:
    """One node, about 1.5x what it computes: a long prompt in four, short ones between."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(1 / 0.055)
        out.append(request(i, t, LONG if rng.random() < 0.25 else SHORT))
    return out


CFG = SimConfig(prefill_nodes=1, capacity_blocks=50_000, block_size=BS)
SCHED = replace(CFG, scheduler=True)


def run(reqs: Sequence[Request], cfg: SimConfig, scheduler: Scheduler | None = None) -> Simulator:
    sim = Simulator(parse_policy("prefixgate"), cfg, scheduler)
    sim.run(reqs)
    return sim


def short_ttft(sim: Simulator, q: float) -> float:
    return percentile(sorted(o.ttft_s for o in sim.outcomes if o.prompt_tokens == SHORT), q)


def test_short_requests_start_sooner_than_first_come_first_served_under_overload() -> None:
    reqs = overload()
    fcfs, sched = run(reqs, CFG), run(reqs, SCHED)
    assert len(fcfs.outcomes) == len(sched.outcomes) == len(reqs)  # the bound is not reached here
    assert short_ttft(sched, 50) < short_ttft(fcfs, 50) / 2
    assert short_ttft(sched, 99) < short_ttft(fcfs, 99)
    assert max(o.wait_s for o in sched.outcomes) > 0 and all(o.wait_s == 0 for o in fcfs.outcomes)
    for o in sched.outcomes:  # the gateway's wait is part of the queue time and of the TTFT
        assert o.wait_s <= o.queue_s + 1e-9 and o.queue_s <= o.ttft_s


def test_no_request_waits_past_the_bound_the_rest_is_refused() -> None:
    reqs = overload(400)
    cfg = replace(SCHED, limits=QueueLimits(max_wait_s=1.0))
    sim = run(reqs, cfg)
    assert sim.refused["expired"] > 0 and sim.refused["full"] == sim.refused["shed"] == 0
    assert len(sim.outcomes) + len(sim.refused_requests) == len(reqs)
    assert max(o.wait_s for o in sim.outcomes) < 1.0
    served = {o.index for o in sim.outcomes}
    assert served.isdisjoint(sim.refused_requests)


def test_two_tenants_share_the_prefill_work_evenly() -> None:
    """``a`` sends ten times what ``b`` sends, all at once, ahead of it: b is served alongside a,
    not after it (first come first served puts every b request last)."""
    a = [request(i, 0.0, 4_096, "a") for i in range(200)]
    b = [request(200 + i, 0.001, 4_096, "b") for i in range(20)]
    reqs = a + b
    fcfs, sched = run(reqs, CFG), run(reqs, SCHED)
    first = sched.started[:40]
    assert 18 <= sum(1 for i in first if i >= 200) <= 20  # one in two of the starts while b waits
    assert all(i < 200 for i in fcfs.started[:200])
    wait_b = max(o.queue_s for o in sched.outcomes if o.index >= 200)
    assert wait_b < percentile(sorted(o.queue_s for o in sched.outcomes if o.index < 200), 50) / 2


class Recorder(Scheduler):
    """The scheduler the simulator drives, keeping every call and what it answered."""

    def __init__(self, limits: QueueLimits) -> None:
        super().__init__(limits)
        self.calls: list[tuple[Any, ...]] = []

    def arrive(self, entry: Entry, views: Sequence[NodeView], now: float, *, blocked: bool = False) -> Admit:
        admit = super().arrive(entry, views, now, blocked=blocked)
        self.calls.append(("arrive", replace(entry), list(views), now, blocked, admit))
        return admit

    def hold(self, entry: Entry) -> str:
        self.calls.append(("hold", replace(entry)))
        return super().hold(entry)

    def take(self, views: Sequence[NodeView], now: float) -> Entry | None:
        got = super().take(views, now)
        self.calls.append(("take", list(views), now, got.ticket if got else None))
        return got

    def expire(self, now: float) -> list[Entry]:
        gone = super().expire(now)
        self.calls.append(("expire", now, [e.ticket for e in gone]))
        return gone


def test_the_simulator_starts_what_the_scheduler_decides_in_its_order() -> None:
    """Replayed on a fresh ``Scheduler`` with the same entries, views and clock, every call gives
    the simulator's answer, and the starts (START verdicts, then takes) are the simulator's order."""
    reqs = [replace(r, tenant="ab"[r.index % 3 == 0]) for r in overload(250)]
    limits = QueueLimits(max_wait_s=1.5, max_requests=12)
    rec = Recorder(limits)
    sim = run(reqs, replace(SCHED, limits=limits), rec)
    fresh = Scheduler(limits)
    starts: list[int] = []
    verdicts: set[Verdict] = set()
    for call in rec.calls:
        if call[0] == "arrive":
            _, entry, views, now, blocked, admit = call
            assert fresh.arrive(replace(entry), views, now, blocked=blocked) == admit
            verdicts.add(admit.verdict)
            if admit.verdict == Verdict.START:
                starts.append(entry.ticket)
        elif call[0] == "hold":
            assert fresh.hold(replace(call[1])) == ""
        elif call[0] == "take":
            _, views, now, ticket = call
            got = fresh.take(views, now)
            assert (got.ticket if got else None) == ticket
            if got is not None:
                starts.append(got.ticket)
        else:
            assert [e.ticket for e in fresh.expire(call[1])] == call[2]
    assert starts == sim.started
    assert {Verdict.START, Verdict.WAIT, Verdict.FULL} <= verdicts
    assert sim.refused["expired"] > 0 and sim.refused["full"] > 0


def test_the_table_scales_a_workload_to_each_load_and_compares_the_modes() -> None:
    reqs = overload(120)
    out = io.StringIO()
    console = Console(file=out, width=200)
    traces = {"synthetic": reqs}
    bases = sched_table.calibrate(traces, parse_policy("prefixgate"), CFG)
    load, _ = bases["synthetic"]
    assert 1.2 < load < 1.8  # ~1.5x one node, as built
    rows = sched_table.run_table(
        traces, {"synthetic": 1.0}, bases, parse_policy("prefixgate"), CFG, [1.3], 2.0, console
    )
    assert [r.mode for r in rows] == ["fcfs", "scheduled", "slo 2 s, shed"]
    fcfs, sched, slo = rows
    assert sched.short_p99_s < fcfs.short_p99_s and slo.shed > 0 and fcfs.shed == 0
    assert "FCFS vs scheduler" in out.getvalue()
