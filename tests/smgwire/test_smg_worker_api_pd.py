"""smg's ``POST /workers`` for split serving over ``grpc://``: a prefill worker registered with
its bootstrap port serves the prefills once the one given on the command line is removed, and
the port the body gives is the one the decode node is sent to."""

from __future__ import annotations

import httpx

from tests.smgwire.conftest import StartNode
from tests.smgwire.test_gateway_over_grpc import body, gateway


async def test_a_prefill_worker_registered_with_its_bootstrap_port_serves(nodes: StartNode) -> None:
    first, dec = await nodes("prefill"), await nodes("decode")
    added, wrong = await nodes("prefill"), await nodes("prefill")
    assert added.bootstrap is not None
    async with gateway("--prefill", f"grpc://{first.address}", "--decode", f"grpc://{dec.address}") as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            spec = {"url": f"grpc://{added.address}", "worker_type": "prefill", "runtime": "sglang"}
            r = await http.post("/workers", json=spec | {"bootstrap_port": added.bootstrap.port})
            assert r.status_code == 202, r.text
            listed = {w["url"]: w for w in (await http.get("/workers")).json()["workers"]}
            assert listed[spec["url"]]["bootstrap_port"] == added.bootstrap.port
            assert listed[spec["url"]]["worker_type"] == "prefill"
            assert (await http.delete(f"/workers/grpc://{first.address}")).status_code == 202
            for _ in range(3):
                r = await http.post("/v1/completions", json=body())
                assert r.status_code == 200, r.text
                assert r.headers["x-prefixgate-route"] == "disaggregated"
                assert r.headers["x-prefixgate-prefill-node"] == spec["url"]

            # the port a body gives is the one used: at a port where no bootstrap server
            # listens, the decode node cannot fetch that prefill's pages
            assert (await http.delete(f"/workers/{spec['url']}")).status_code == 202
            bad = {"url": f"grpc://{wrong.address}", "worker_type": "prefill", "bootstrap_port": 1}
            assert (await http.post("/workers", json=bad)).status_code == 202
            r = await http.post("/v1/completions", json=body())
    assert r.status_code == 503, r.text
    assert "bootstrap 127.0.0.1:1 unreachable" in r.json()["error"]["message"], r.text
