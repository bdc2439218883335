"""Fault drills print one table at the end of the run: sent / succeeded / retried / fell back / failed."""

from __future__ import annotations

from typing import Any

from tests.faults.cluster import Tally

REPORT: list[Tally] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORT:
        return
    tr = terminalreporter
    tr.section("prefixgate fault drills")
    head = (
        f"{'scenario':<52}{'sent':>6}{'ok':>6}{'retried':>9}{'fallback':>9}{'failed':>8}{'429':>6}"
        f"{'stream err':>11}"
    )
    tr.write_line(head)
    for t in REPORT:
        tr.write_line(
            f"{t.scenario:<52}{t.sent:>6}{t.succeeded:>6}{t.retried:>9}{t.fell_back:>9}{t.failed:>8}"
            f"{t.rejected_429:>6}{t.stream_errors:>11}  {t.note}"
        )
