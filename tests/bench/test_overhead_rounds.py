"""``bench overhead`` over several rounds: each figure is the median of the rounds, and how far
the node alone moved between rounds is reported beside the verdicts, so a reader can tell a
target's difference from the machine's noise."""

from __future__ import annotations

from typing import Any

from prefixgate.bench.overhead import medians, spread_line


def _row(target: str, req_per_s: float, rnd: int, *, clients: int = 32) -> dict[str, Any]:
    return {
        "target": target,
        "clients": clients,
        "prompt_bytes": 2048,
        "stream": False,
        "req_per_s": req_per_s,
        "errors": 1,
        "ok": 10,
        "round": rnd,
    }


def test_the_median_of_the_rounds_and_their_range() -> None:
    rows = [_row("direct", r, i) for i, r in enumerate((600.0, 1000.0, 800.0))]
    rows += [_row("smg", r, i) for i, r in enumerate((500.0, 510.0, 490.0))]
    out = {r["target"]: r for r in medians(rows)}
    assert out["direct"]["req_per_s"] == 800.0 and out["direct"]["req_per_s_range"] == [600.0, 1000.0]
    assert out["direct"]["rounds"] == 3 and out["direct"]["errors"] == 3 and "round" not in out["direct"]
    assert out["smg"]["req_per_s_range"] == [490.0, 510.0]


def test_the_node_alones_spread_is_reported_per_cell() -> None:
    rows = [_row("direct", r, i) for i, r in enumerate((600.0, 1000.0))]
    rows += [_row("direct", r, i, clients=1) for i, r in enumerate((300.0, 300.0))]
    line = spread_line(medians(rows))
    assert line == (
        "the node alone (direct), req/s across rounds: "
        "JSON 2 KB c=32 600-1000 (±20 %); JSON 2 KB c=1 300-300 (±0 %)"
    )


def test_one_round_reports_no_spread() -> None:
    assert spread_line([{**_row("direct", 600.0, 0), "rounds": 1}]) is None
