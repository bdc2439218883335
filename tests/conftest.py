"""Fixtures shared by every test package."""

from __future__ import annotations

import compileall
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from prefixgate.v1 import node_pb2_grpc

# Fault drills time a cluster of processes against wall-clock bounds (a probe within 3 s, a share
# of traffic within a window); on a machine whose cores other test files share, one may miss its
# window. Each drill gets one more run; a drill that fails twice fails the suite.
DRILLS = ("faults", "cluster", "shared_index", "replicas")


ROOT = Path(__file__).resolve().parent.parent
# Where the project's own modules are (prefixgate/ links to them; ``proto`` is the generated code).
SOURCES = ("gateway", "cachetier", "backends", "bench", "openai", "proto", "prefixgate", "tests")


def pytest_configure(config: pytest.Config) -> None:
    """Compile the project's modules once, before any test starts a process.

    The suite starts hundreds of gateways, nodes and tokenizer processes. Where
    ``PYTHONDONTWRITEBYTECODE`` is set, none of them writes the bytecode it compiles, so each one
    compiles every prefixgate module it imports again: 0.4 s of CPU a gateway on two cores, some
    70 s of the suite. ``compileall`` writes it whatever that variable says (the venv's packages are
    compiled at install, ``--compile-bytecode``)."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller has done it
        return
    for name in SOURCES:
        compileall.compile_dir(ROOT / name, quiet=2, workers=0, rx=re.compile(r"/vendor/"))
    _rewrite_test_modules(config)


def _rewrite_test_modules(config: pytest.Config) -> None:
    """Rewrite the test modules' asserts once, for every xdist worker.

    pytest keeps a module's rewritten code in a pyc of its own, but writes none where
    ``PYTHONDONTWRITEBYTECODE`` is set: each of the four workers then rewrote all 490 test
    modules while collecting them, some 9 s of CPU each. Written here, once, the workers read
    them (pytest reads its pyc whatever that variable says). pytest's own functions, which are
    not its public API: if they change, the workers rewrite as before."""
    if config.getoption("assertmode", "rewrite") != "rewrite":
        return
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        for fn in sorted((ROOT / "tests").rglob("*.py")):
            if "vendor" in fn.parts or not (fn.name.startswith("test_") or fn.name == "conftest.py"):
                continue
            cache = rewrite.get_cache_dir(fn)
            pyc = cache / (fn.name[:-3] + rewrite.PYC_TAIL)
            if rewrite.try_makedirs(cache) and rewrite._read_pyc(fn, pyc) is None:
                source_hash, co = rewrite._rewrite_test(fn, config)
                rewrite._write_pyc(state, co, source_hash, pyc)
    except (ImportError, AttributeError, KeyError, TypeError, OSError, SyntaxError):
        return


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers more than the cores this process may use. Much of the suite waits on
    child processes and timers, so spare workers keep the cores busy. Two cores: 441 s of tests
    with two workers, 366 s with three and 383 s with four on one machine; on a slower one, after
    the long folders were handed out first (``LONGEST_FIRST``), 305-335 s with three and 289 s
    with four."""
    return len(os.sched_getaffinity(0)) + 2


# Long scenario runs, marked ``drill`` and left out of the default run (``addopts`` in
# pyproject.toml; ``pytest -m drill`` runs them): the fault drills, which hang, kill and flood
# clusters of processes and wait out probes and timeouts (docs/faults.md's table comes from them),
# Redis Cluster's lost-shard drill, and the benchmark commands run end to end. Together they took
# as long as the rest of the suite on two cores.
LONG_RUNS = ("faults", "bench_live")
LONG_FILES = ("tests/bench/test_chaos.py",)


# Folders whose files start whole stacks of processes, the longest first (seconds a folder, two
# cores: workers 97, e2e 98, httpworkers 82, smgwire 71, interop 69). Their files are handed to
# the xdist workers first, in this order, then the rest in collection order: a long file taken
# last kept one worker busy while the others had nothing left to do.
LONGEST_FIRST = ("workers", "e2e", "httpworkers", "smgwire", "interop", "replicas", "shared_index", "cluster")


def _start_rank(item: pytest.Item) -> int:
    folder = item.path.parent.name
    in_tests = item.path.parent.parent.name == "tests"
    return LONGEST_FIRST.index(folder) if in_tests and folder in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_start_rank)  # stable: each file's tests stay together and in order
    for item in items:
        in_tests = item.path.parent.parent.name == "tests"
        if item.path.parent.name in DRILLS and in_tests:
            item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=1))
        rel = item.path.as_posix()
        if (item.path.parent.name in LONG_RUNS and in_tests) or rel.endswith(LONG_FILES):
            item.add_marker(pytest.mark.drill)


@pytest.fixture
async def stub() -> AsyncIterator[Callable[[str], Any]]:
    """``stub(address)``: a Node stub on a channel closed after the test."""
    channels: list[grpc.aio.Channel] = []

    def make(address: str) -> Any:
        ch = grpc.aio.insecure_channel(address)
        channels.append(ch)
        return node_pb2_grpc.NodeStub(ch)

    yield make
    for ch in channels:
        await ch.close()
