"""An admin change made through one gateway worker holds on its siblings at once, not on the
membership beat: the worker that records it tells the others through the store's pub/sub
(``gateway.cluster.membership.AdminNudges``) and they sync then."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from prefixgate.gateway.ops import processes
from tests.faults.drills import until
from tests.helpers import free_port, spawn
from tests.httpworkers.conftest import Worker, start_node, wait_models
from tests.workers.support import Gateway

MODEL = "m-nudge"
#: How long a sibling may take: a nudge and a read of the store, well under a second.
NUDGED_S = 5.0


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[Gateway, list[Worker]]]:
    nodes: list[Worker] = [start_node(MODEL), start_node(MODEL), start_node(MODEL)]
    port = free_port()
    # The beat 10 minutes apart: within the test's waits only a sibling's nudge can bring a change.
    env = {"PREFIXGATE_MEMBERSHIP_INTERVAL_S": "600"}
    args = ["gateway", "--port", str(port), "--workers", "2", "--worker-urls", nodes[0].url, nodes[1].url]
    proc = spawn(args, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for(r'"event": ?"workers_ready"', timeout=90)
        wait_models(base, {MODEL})
        yield Gateway(proc, base, MODEL), nodes
    finally:
        processes.stop_all([proc, *[n.proc for n in nodes if n.proc is not None]])


def _node(client: httpx.Client, address: str) -> dict[str, Any] | None:
    for n in client.get("/admin/nodes").json()["data"]:
        if address in (n["id"], n.get("address")):
            return dict(n)
    return None


def test_drain_add_remove_and_switches_through_one_worker_hold_on_the_other(
    gateway: tuple[Gateway, list[Worker]],
) -> None:
    gw, nodes = gateway
    with gw.two_workers() as (here, there):
        drained = here.get("/admin/nodes").json()["data"][0]
        assert _node(there, drained["id"])["draining"] is False  # type: ignore[index]
        assert here.post(f"/admin/nodes/{drained['id']}/drain", json={"drain": True}).status_code == 200
        assert until(lambda: _node(there, drained["id"])["draining"] is True, NUDGED_S)  # type: ignore[index]
        assert here.post(f"/admin/nodes/{drained['id']}/drain", json={"drain": False}).status_code == 200
        assert until(lambda: _node(there, drained["id"])["draining"] is False, NUDGED_S)  # type: ignore[index]

        added = nodes[2].url
        r = here.post("/admin/nodes", json={"role": "monolithic", "address": added})
        assert r.status_code in (200, 201), r.text
        assert until(lambda: _node(there, added) is not None, NUDGED_S)
        assert here.delete(f"/admin/nodes/{_node(here, added)['id']}").status_code == 200  # type: ignore[index]
        assert until(lambda: _node(there, added) is None, NUDGED_S)

        assert here.put("/admin/switches", json={"normalization": False}).status_code == 200
        assert until(lambda: there.get("/admin/switches").json()["normalization"] is False, NUDGED_S)
        assert here.put("/admin/switches", json={"normalization": True}).status_code == 200
        assert until(lambda: there.get("/admin/switches").json()["normalization"] is True, NUDGED_S)
    assert gw.events("membership_synced")  # the sibling synced on its nudges
