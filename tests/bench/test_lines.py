"""``prefixgate bench lines``: the line counting, its file and its table, and the wrapper a
gateway runs under, on a small program (a gateway traced for hundreds of chats takes minutes:
the command itself is run by hand, bench/README.md)."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefixgate.bench import launch, lines
from prefixgate.bench.lines import LineCounts, Tracer, render, where


def leaf() -> int:
    a = 1
    b = 2
    return a + b


def middle() -> int:
    x = leaf()
    return x + leaf()


@dataclass
class Pair:
    left: int
    right: int


async def sleeper() -> int:
    a = 1
    await asyncio.sleep(0)
    return a + 1


def test_own_lines_are_the_functions_and_inclusive_ones_its_callees_too() -> None:
    tracer = Tracer()
    tracer.start()
    middle()
    counts = tracer.stop()
    name_leaf, name_middle = where(leaf.__code__), where(middle.__code__)
    assert counts.own[name_leaf] == 6  # three lines, twice
    assert counts.own[name_middle] == 2
    assert counts.inclusive[name_middle] == 8 and counts.inclusive[name_leaf] == 6
    assert counts.calls[name_leaf] == 2 and counts.calls[name_middle] == 1


def test_a_coroutine_counts_across_its_awaits_and_each_resumption_is_a_call() -> None:
    tracer = Tracer()

    async def main() -> int:
        tracer.start()
        try:
            return await sleeper()
        finally:
            tracer.stop()

    assert asyncio.run(main()) == 2
    name = where(sleeper.__code__)
    assert tracer.counts.own[name] == 3
    assert tracer.counts.calls[name] == 2  # started, then resumed after the sleep


def test_dataclass_values_are_counted_by_class() -> None:
    tracer = Tracer()
    tracer.start()
    pairs = [Pair(i, i) for i in range(3)]
    counts = tracer.stop()
    assert len(pairs) == 3
    assert counts.made == {f"{__name__}.Pair": 3}


def test_nothing_is_counted_after_stop() -> None:
    tracer = Tracer()
    tracer.start()
    leaf()
    counts = tracer.stop()
    leaf()
    assert counts.own[where(leaf.__code__)] == 3


def test_the_count_survives_its_file_and_the_table_is_per_request() -> None:
    counts = LineCounts()
    counts.own.update({"a.py:1(f)": 40, "a.py:9(g)": 20})
    # main was running before the count began: it holds every line and is never called
    counts.inclusive.update({"main.py:1(main)": 80, "a.py:1(f)": 60, "a.py:9(g)": 20})
    counts.calls.update({"a.py:1(f)": 20, "a.py:9(g)": 20})
    counts.made.update({"m.V": 30})
    again = LineCounts.from_json(counts.to_json())
    assert again == counts
    table = render(again, requests=20, top=5)
    assert table[0].startswith("4.0 lines a request in all")
    assert table[2].split() == ["3.0", "2.0", "1.00", "a.py:1(f)"]
    assert table[3].split() == ["1.0", "1.0", "1.00", "a.py:9(g)"]
    assert "main" not in "".join(table)
    assert "1.5 dataclass values made a request" in table[4]
    assert table[5].split() == ["1.50", "m.V"]


def test_where_names_a_function_from_its_package_down() -> None:
    assert where(lines.render.__code__).startswith("bench/lines.py:")
    assert where(asyncio.sleep.__code__).startswith("asyncio/tasks.py:")


def test_a_program_run_under_the_wrapper_is_counted_between_the_two_signals(tmp_path: Path) -> None:
    (tmp_path / "traced_program.py").write_text(
        textwrap.dedent(
            """
            import os, signal

            def before():
                return 1

            def counted():
                a = 1
                return a

            before()
            os.kill(os.getpid(), signal.SIGUSR1)
            counted()
            os.kill(os.getpid(), signal.SIGUSR2)
            before()
            """
        )
    )
    out = tmp_path / "counts.json"
    cmd = [sys.executable, "-m", "prefixgate.bench.lines", "--trace-to", str(out), "--"]
    cmd += [sys.executable, "-m", "traced_program"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    counts = LineCounts.from_json(out.read_bytes())
    own = {name.split("(")[1].rstrip(")"): n for name, n in counts.own.items() if "traced_program" in name}
    assert own.get("counted") == 2 and "before" not in own


def test_a_wrong_command_line_is_refused() -> None:
    assert lines.traced(["--trace-to", "x.json", "python", "-m", "mod"]) == 2


def test_mounted_under_the_prefixgate_command() -> None:
    from prefixgate.cli import build_parser

    args = build_parser().parse_args(["bench", "lines", "--target", "grpc", "--requests", "50"])
    assert args.func is lines.run and args.target == "grpc" and args.requests == 50


def test_the_chats_may_be_streamed_and_longer_and_a_count_of_tokens_is_whole() -> None:
    p = argparse.ArgumentParser()
    lines.add_arguments(p)
    args = p.parse_args([])
    assert (args.stream, args.max_tokens) == (False, 8)  # as bench overhead's chats
    assert args.stream_interval == launch.NodeOptions().stream_interval
    args = p.parse_args(["--stream", "--max-tokens", "520", "--stream-interval", "1"])
    assert (args.stream, args.max_tokens, args.stream_interval) == (True, 520, 1)
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit):
            p.parse_args(["--max-tokens", bad])
