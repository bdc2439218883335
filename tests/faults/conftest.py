"""Fault drills print one table at the end of the run: sent / succeeded / retried / fell back / failed.

The drill modules' clusters are here: module-scoped, one per protocol (see ``drills.py``)."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from prefixgate.bench.redis_cluster import start_redis
from prefixgate.gateway.ops.processes import Child
from tests.faults.cluster import Cluster
from tests.faults.drills import PROTOCOLS, REPORT
from tests.helpers import free_port


@pytest.fixture(scope="module")
def redis_port() -> Iterator[tuple[int, list[Child]]]:
    """A Redis of the module's own (a drill restarts it empty); the list holds its processes."""
    port = free_port()
    procs = [start_redis(port)]
    try:
        yield port, procs
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


@pytest.fixture(scope="module", params=PROTOCOLS)
def cluster(request: pytest.FixtureRequest, redis_port: tuple[int, list[Child]]) -> Iterator[Cluster]:
    port, _ = redis_port
    protocol: str = request.param
    c = Cluster.create(
        2,
        2,
        ["--time-scale", "10", "--capacity-blocks", "4096"],
        protocol=protocol,
        # both clusters share the module's Redis: each its own DB and key prefix
        gateway_args=["--redis", f"redis://127.0.0.1:{port}/{PROTOCOLS.index(protocol) + 1}"],
        gateway_env={"PREFIXGATE_REDIS_PREFIX": f"prefixgate-test-{uuid.uuid4().hex[:8]}:"},
    )
    c.start()
    try:
        yield c
    finally:
        assert c.stop() == 0


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
