"""``prefixgate bench instructions``: the arithmetic, the dump reading and the table (the counting
itself needs a router under callgrind for tens of seconds: it is run by hand, bench/README.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prefixgate.bench import instructions
from prefixgate.bench.instructions import Count, render


def test_a_request_costs_its_window_less_the_quiet_rate_over_the_requests() -> None:
    c = Count(
        "prefixgate-http", nodes=1, requests=8, instructions=1_000_000, window_s=2.0, quiet_per_s=100_000
    )
    assert c.per_request == pytest.approx((1_000_000 - 2.0 * 100_000) / 8)
    # background that outweighs the window (a stalled router) is no negative cost
    idle = Count("prefixgate-http", nodes=1, requests=8, instructions=10, window_s=2.0, quiet_per_s=100_000)
    assert idle.per_request == 0


def test_a_dump_is_read_once_written_out(tmp_path: Path) -> None:
    dump = tmp_path / "cg.out.1"
    dump.write_text("version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 0\n")
    assert instructions._totals(dump) is None  # the totals line comes last
    dump.write_text(dump.read_text() + "fl=x.c\nfn=f\n3 7\ntotals: 123456\n")
    assert instructions._totals(dump) == 123456


def test_the_table_has_a_column_per_node_count_and_a_row_per_target() -> None:
    counts = [
        Count("prefixgate-http", 1, 100, 300_000_000, 1.0, 0.0),
        Count("prefixgate-http", 8, 100, 500_000_000, 1.0, 0.0),
        Count("smg-http", 1, 100, 75_000_000, 1.0, 0.0),
    ]
    table = render(counts)
    assert [c.header for c in table.columns] == ["target", "1 node", "8 nodes", "quiet, M/s"]
    assert table.row_count == 2
    cells = {c.header: list(c.cells) for c in table.columns}
    assert cells["1 node"] == ["3.00", "0.75"] and cells["8 nodes"] == ["5.00", "-"]


def test_without_valgrind_it_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    args = argparse.Namespace(
        nodes=[1],
        requests=5,
        peers="",
        peers_venv=str(tmp_path),
        baseline_src=None,
        json_out=None,
        floor=False,
    )
    assert instructions.run(args) == 2


def test_mounted_under_the_prefixgate_command() -> None:
    from prefixgate.cli import build_parser

    args = build_parser().parse_args(["bench", "instructions", "--nodes", "1", "8", "--peers", "smg"])
    assert args.func is instructions.run and args.nodes == [1, 8] and args.peers == "smg"
    assert instructions._targets(args) == ["prefixgate-http", "prefixgate-grpc", "smg-http", "smg-grpc"]
    args = build_parser().parse_args(["bench", "instructions", "--floor"])
    floors = ["floor-http", "essentials-http"]
    assert instructions._targets(args) == ["prefixgate-http", "prefixgate-grpc", *floors]
