"""``prefixgate bench replay --scheduler-table``: first come first served against the gateway's
scheduler, on the public traces pushed past the cluster's capacity, in one table.

**Capacity.** A trace's offered load is measured, not assumed: one FCFS pass at the trace's
default time compression (``replay.DEFAULT_TIME_SCALE``, where no request falls back) records each
request's actual hit; the prefill seconds those requests cost at the profile (uncached tokens after
their cached context, ``prefill_seconds``; a fallback counts its whole prompt) over
(prefill nodes x span of arrivals) is the load. The arrivals are then compressed further by
``target / load``, so that the same work at the same hit rate asks ``target`` (1.3, 1.6) times what
the nodes can compute. The hit rate moves a little with timing, so the figure is close, not exact.

**Rows**, per trace and load: ``fcfs`` (every request sent at once to its node's queue),
``scheduled`` (the gateway's ``Scheduler``, default ``QueueLimits`` and ``RoomRule``), and
``scheduled, slo`` (every request carries a TTFT target and is sheddable: the scheduler refuses at
arrival what its predicted wait says will be late). **Figures**: TTFT p50/p99 of short prompts
(under ``SHORT_TOKENS``) and of all served requests, the longest wait of any served request before its
prefill started (queue in the gateway and on the node), the hit rate (served requests), the share
of offered requests that missed the target (served late, or refused), the refusals (queue full,
shed at arrival, expired after ``max_wait_s``) and the fallbacks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from rich.console import Console
from rich.table import Table

from prefixgate.bench.report import percentile
from prefixgate.bench.simulator import SimConfig, Simulator
from prefixgate.bench.workloads import Request, load_workload
from prefixgate.gateway.routing.base import Policy
from prefixgate.gateway.scheduling.classes import Schedule

SHORT_TOKENS = 4096  # a "short" prompt: under 4K tokens


@dataclass(frozen=True, slots=True)
class Figures:
    trace: str
    load: float
    mode: str
    requests: int
    short_p50_s: float
    short_p99_s: float
    all_p50_s: float
    all_p99_s: float
    max_wait_s: float
    hit_rate: float
    missed: float  # share of offered requests served later than the target, or refused
    full: int
    shed: int
    expired: int
    fallbacks: int

    def as_json(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def measured_load(requests: Sequence[Request], policy: Policy, config: SimConfig) -> tuple[float, float]:
    """(offered load, hit rate) of ``requests`` as timed, from one FCFS pass."""
    sim = Simulator(policy, replace(config, scheduler=False))
    summary = sim.run(requests)
    prof = config.profile
    work = sum(prof.prefill_s(o.prompt_tokens - o.cached_tokens, o.cached_tokens) for o in sim.outcomes)
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    return (work / (config.prefill_nodes * span) if span > 0 else 0.0), summary.hit_rate


def compress(requests: Sequence[Request], factor: float) -> list[Request]:
    """The same requests arriving ``factor`` times as fast."""
    t0 = requests[0].arrival_s if requests else 0.0
    return [replace(r, arrival_s=t0 + (r.arrival_s - t0) / factor) for r in requests]


def figures(trace: str, load: float, mode: str, sim: Simulator, offered: int, slo_s: float) -> Figures:
    out = sim.outcomes
    ttft = sorted(o.ttft_s for o in out)
    short = sorted(o.ttft_s for o in out if o.prompt_tokens < SHORT_TOKENS)
    prompt = sum(o.prompt_tokens for o in out)
    refused = sim.refused
    late = sum(1 for o in out if o.ttft_s > slo_s) + len(sim.refused_requests)
    return Figures(
        trace=trace,
        load=load,
        mode=mode,
        requests=offered,
        short_p50_s=percentile(short, 50),
        short_p99_s=percentile(short, 99),
        all_p50_s=percentile(ttft, 50),
        all_p99_s=percentile(ttft, 99),
        max_wait_s=max((o.queue_s for o in out), default=0.0),
        hit_rate=sum(o.cached_tokens for o in out) / prompt if prompt else 0.0,
        missed=late / offered if offered else 0.0,
        full=refused["full"],
        shed=refused["shed"],
        expired=refused["expired"],
        fallbacks=sum(1 for o in out if not o.node),
    )


def modes(config: SimConfig, slo_s: float) -> list[tuple[str, SimConfig]]:
    sched = replace(config, scheduler=True)
    slo = replace(sched, schedule=Schedule("slo", 0, True, slo_s))
    return [("fcfs", config), ("scheduled", sched), (f"slo {slo_s:g} s, shed", slo)]


def variants(config: SimConfig) -> list[tuple[str, SimConfig]]:
    """The scheduled mode with one of the queue's or the room rule's values changed (the sweep)."""
    sched = replace(config, scheduler=True)
    lim, room = sched.limits, sched.room
    return [
        ("fcfs", config),
        ("scheduled (defaults)", sched),
        ("max_defer_s=30", replace(sched, limits=replace(lim, max_defer_s=30.0))),
        ("shortest_first=0", replace(sched, limits=replace(lim, shortest_first=0.0))),
        (
            "shortest_first=100,max_defer_s=30",
            replace(sched, limits=replace(lim, shortest_first=100.0, max_defer_s=30.0)),
        ),
        ("queue max_requests=256", replace(sched, limits=replace(lim, max_requests=256))),
        ("queue max_requests=16384", replace(sched, limits=replace(lim, max_requests=16384))),
        (
            "queue max_requests=16384,max_defer_s=30",
            replace(sched, limits=replace(lim, max_requests=16384, max_defer_s=30.0)),
        ),
        ("room window_s=0.2", replace(sched, room=replace(room, window_s=0.2))),
        ("room window_s=0.01", replace(sched, room=replace(room, window_s=0.01))),
        ("room max_requests=2", replace(sched, room=replace(room, max_requests=2))),
    ]


def calibrate(
    traces: dict[str, list[Request]], policy: Policy, config: SimConfig
) -> dict[str, tuple[float, float]]:
    """Each trace's (offered load, FCFS hit rate) as loaded (``measured_load``)."""
    return {name: measured_load(reqs, policy, config) for name, reqs in traces.items()}


def runs(
    name: str,
    load: float,
    timed: Sequence[Request],
    policy: Policy,
    configs: Sequence[tuple[str, SimConfig]],
    slo_s: float,
) -> list[Figures]:
    out: list[Figures] = []
    for mode, cfg in configs:
        sim = Simulator(policy, cfg)
        sim.run(timed)
        out.append(figures(name, load, mode, sim, len(timed), slo_s))
    return out


def run_table(
    traces: dict[str, list[Request]],
    scales: dict[str, float],
    bases: dict[str, tuple[float, float]],
    policy: Policy,
    config: SimConfig,
    loads: Sequence[float],
    slo_s: float,
    console: Console,
) -> list[Figures]:
    """The table: every trace at every load, FCFS, scheduled, scheduled with a shed target."""
    rows: list[Figures] = []
    for name, reqs in traces.items():
        base, hit = bases[name]
        console.print(
            f"{name}: {len(reqs)} requests; at time / {scales[name]:g} FCFS hit rate {hit * 100:.2f} %, "
            f"offered load {base * 100:.1f} % of {config.prefill_nodes} {config.profile.name} prefill nodes"
        )
        for load in loads:
            factor = load / base
            rows += runs(name, load, compress(reqs, factor), policy, modes(config, slo_s), slo_s)
            console.print(f"  load {load:g}x: time / {scales[name] * factor:.2f}")
    console.print(render(rows, slo_s, f"FCFS vs scheduler, {config.prefill_nodes} prefill nodes"))
    return rows


def run_sweep(
    traces: dict[str, list[Request]],
    bases: dict[str, tuple[float, float]],
    policy: Policy,
    config: SimConfig,
    load: float,
    slo_s: float,
    console: Console,
) -> list[Figures]:
    """Each of ``variants`` on every trace at ``load`` x capacity."""
    rows: list[Figures] = []
    for name, reqs in traces.items():
        timed = compress(reqs, load / bases[name][0])
        rows += runs(name, load, timed, policy, variants(config), slo_s)
    console.print(render(rows, slo_s, f"scheduler values at {load:g}x capacity"))
    return rows


def render(rows: Sequence[Figures], slo_s: float, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    cols = (
        "trace",
        "load",
        "mode",
        "short p50",
        "short p99",
        "all p50",
        "all p99",
        "max wait",
        "hit rate",
        "vs fcfs",
        f"> {slo_s:g} s",
        "full",
        "shed",
        "expired",
        "fallbacks",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("trace", "mode") else "right")
    ref: dict[tuple[str, float], float] = {}
    for r in rows:
        if r.mode == "fcfs":
            ref[(r.trace, r.load)] = r.hit_rate
        base = ref.get((r.trace, r.load), r.hit_rate)
        table.add_row(
            r.trace,
            f"{r.load:g}x",
            r.mode,
            f"{r.short_p50_s:.3f}",
            f"{r.short_p99_s:.3f}",
            f"{r.all_p50_s:.3f}",
            f"{r.all_p99_s:.3f}",
            f"{r.max_wait_s:.1f}",
            f"{r.hit_rate * 100:.2f} %",
            f"{(r.hit_rate - base) * 100:+.2f}",
            f"{r.missed * 100:.1f} %",
            str(r.full),
            str(r.shed),
            str(r.expired),
            str(r.fallbacks),
        )
    return table


def load_traces(
    args: argparse.Namespace, options: Callable[[argparse.Namespace, str], Any]
) -> tuple[dict[str, list[Request]], dict[str, float]]:
    """The requests of every ``--scheduler-traces`` format, at its default time compression."""
    traces: dict[str, list[Request]] = {}
    scales: dict[str, float] = {}
    for fmt in args.scheduler_traces:
        opts = options(args, fmt)
        path = args.trace if args.trace and len(args.scheduler_traces) == 1 else None
        traces[fmt] = load_workload(fmt, path, opts).requests
        scales[fmt] = opts.time_scale
    return traces, scales
