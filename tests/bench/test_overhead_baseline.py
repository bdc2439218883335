"""``bench overhead --baseline-src`` and ``--baseline-python``: a second prefixgate measured in
the same run, from another source tree, under another interpreter, or both."""

from __future__ import annotations

import argparse
import sys

from prefixgate.bench.overhead import add_arguments, baseline_gateway


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate bench overhead")
    add_arguments(p)
    return p.parse_args(list(argv))


def test_a_baseline_from_another_tree_or_under_another_interpreter() -> None:
    assert baseline_gateway(_parse()) is None
    assert baseline_gateway(_parse("--baseline-src", "/tmp/before")) == (
        sys.executable,
        {"PYTHONPATH": "/tmp/before"},
    )
    # an optimized build's venv, say: its own prefixgate, or this tree's with --baseline-src too
    assert baseline_gateway(_parse("--baseline-python", "/opt/pgo/bin/python")) == ("/opt/pgo/bin/python", {})
    assert baseline_gateway(_parse("--baseline-python", "/opt/pgo/bin/python", "--baseline-src", "/b")) == (
        "/opt/pgo/bin/python",
        {"PYTHONPATH": "/b"},
    )
