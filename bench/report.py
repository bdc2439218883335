"""Per-request outcomes -> per-policy figures, table and JSON (shared by sim and live modes)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from prefixgate.gateway.vocab import Mode


@dataclass(slots=True)
class Outcome:
    """What happened to one request (times in seconds of the replay's clock)."""

    index: int
    node: str  # prefill node ("" when it fell back)
    route: str  # a Mode (live: the x-prefixgate-route header, "live" when absent)
    prompt_tokens: int
    cached_tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    ttft_s: float
    wait_s: float = 0.0  # of queue_s, in the gateway's own queue (the simulator's scheduled mode)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0 when empty)."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return float(sorted_values[k])


@dataclass(slots=True)
class PolicySummary:
    requests: int
    hit_rate: float  # cached prompt tokens / prompt tokens
    prefill_tokens: int  # tokens computed (prefill nodes and fallbacks)
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    queue_mean_s: float
    queue_p99_s: float
    imbalance: float  # max / mean of per-node busy seconds
    utilisation: float  # busy seconds / (nodes x makespan)
    fallbacks: int
    requests_per_node: dict[str, int] = field(default_factory=dict)
    busy_s_per_node: dict[str, float] = field(default_factory=dict)
    makespan_s: float = 0.0
    wall_s: float = 0.0
    refused: dict[str, int] = field(default_factory=dict)  # by the gateway's scheduler, by reason

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "hit_rate": round(self.hit_rate, 6),
            "prefill_tokens": self.prefill_tokens,
            "ttft_p50_s": round(self.ttft_p50_s, 6),
            "ttft_p95_s": round(self.ttft_p95_s, 6),
            "ttft_p99_s": round(self.ttft_p99_s, 6),
            "ttft_mean_s": round(self.ttft_mean_s, 6),
            "queue_mean_s": round(self.queue_mean_s, 6),
            "queue_p99_s": round(self.queue_p99_s, 6),
            "imbalance": round(self.imbalance, 6),
            "utilisation": round(self.utilisation, 6),
            "fallbacks": self.fallbacks,
            "requests_per_node": dict(self.requests_per_node),
            "busy_s_per_node": {k: round(v, 3) for k, v in self.busy_s_per_node.items()},
            "makespan_s": round(self.makespan_s, 3),
            "wall_s": round(self.wall_s, 3),
            "refused": dict(self.refused),
        }


def imbalance(busy: Mapping[str, float]) -> float:
    """max / mean of per-node busy time: 1.0 is perfect balance, N means one node did all."""
    if not busy:
        return 1.0
    mean = sum(busy.values()) / len(busy)
    return max(busy.values()) / mean if mean > 0 else 1.0


def summarize(
    outcomes: Sequence[Outcome], nodes: Sequence[str], busy_s: Mapping[str, float], makespan_s: float
) -> PolicySummary:
    prompt = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    ttft = sorted(o.ttft_s for o in outcomes)
    queue = sorted(o.queue_s for o in outcomes)
    per_node = dict.fromkeys(nodes, 0)
    for o in outcomes:
        if o.node:
            per_node[o.node] = per_node.get(o.node, 0) + 1
    n = max(1, len(outcomes))
    busy = {k: float(busy_s.get(k, 0.0)) for k in nodes}
    total_busy = sum(busy.values())
    return PolicySummary(
        requests=len(outcomes),
        hit_rate=cached / prompt if prompt else 0.0,
        prefill_tokens=prompt - cached,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p95_s=percentile(ttft, 95),
        ttft_p99_s=percentile(ttft, 99),
        ttft_mean_s=sum(ttft) / n,
        queue_mean_s=sum(queue) / n,
        queue_p99_s=percentile(queue, 99),
        imbalance=imbalance(busy),
        utilisation=total_busy / (len(nodes) * makespan_s) if makespan_s > 0 and nodes else 0.0,
        fallbacks=sum(1 for o in outcomes if o.route == Mode.FALLBACK),
        requests_per_node=per_node,
        busy_s_per_node=busy,
        makespan_s=makespan_s,
    )


def render_table(
    title: str, policies: Mapping[str, PolicySummary], bound: Mapping[str, float] | None = None
) -> Table:
    table = Table(title=title, title_justify="left")
    for col in (
        "policy",
        "hit rate",
        "vs bound",
        "prefill Mtok",
        "TTFT p50",
        "p95",
        "p99",
        "queue mean",
        "imbalance",
        "util",
        "fallbacks",
        "req/node",
        "sim s",
    ):
        table.add_column(col, justify="left" if col in ("policy", "req/node") else "right")
    ref = bound.get("hit_rate", 0.0) if bound else 0.0
    for name, s in policies.items():
        table.add_row(
            name,
            f"{s.hit_rate * 100:.2f} %",
            f"{s.hit_rate / ref * 100:.1f} %" if ref else "-",
            f"{s.prefill_tokens / 1e6:.1f}",
            f"{s.ttft_p50_s:.3f}",
            f"{s.ttft_p95_s:.3f}",
            f"{s.ttft_p99_s:.3f}",
            f"{s.queue_mean_s:.3f}",
            f"{s.imbalance:.3f}",
            f"{s.utilisation * 100:.0f} %",
            str(s.fallbacks),
            "/".join(str(v) for v in s.requests_per_node.values()),
            f"{s.wall_s:.1f}",
        )
    if bound:
        table.add_row("bound: global LRU", f"{ref * 100:.2f} %", "100.0 %", *[""] * 10)
        if "unbounded_hit_rate" in bound:
            table.caption = f"unbounded single cache: {bound['unbounded_hit_rate'] * 100:.2f} % hit rate"
    return table


def print_table(
    title: str,
    policies: Mapping[str, PolicySummary],
    bound: Mapping[str, float] | None = None,
    console: Console | None = None,
) -> None:
    (console or Console(width=max(160, Console().width))).print(render_table(title, policies, bound))


def print_error(console: Console, err: BaseException) -> None:
    """A benchmark that cannot start says why in one line (never wrapped: a script can grep it)."""
    console.print(f"[red]error:[/] {escape(str(err))}", soft_wrap=True)


def write_json(path: str, report: Any, console: Console) -> None:
    """The ``--json FILE`` of every bench: the same figures as the table, indented."""
    Path(path).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    console.print(f"wrote {path}")
