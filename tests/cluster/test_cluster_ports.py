"""The cluster harness's ports: a node's bus port (port + 10000) taken by another process before
the node binds it made Redis exit ("Failed listening"), and every test on that cluster erred."""

from __future__ import annotations

import socket

from prefixgate.bench.redis_cluster import BUS_OFFSET, RedisClusterHarness
from prefixgate.gateway.ops.stack import port_range


def test_node_and_bus_ports_lie_below_the_ephemeral_range() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = port_range(BUS_OFFSET)
    assert len(ports) >= 1_000
    assert ports[-1] + BUS_OFFSET < ephemeral_low


def test_a_node_whose_bus_port_was_taken_starts_on_another_pair() -> None:
    harness = RedisClusterHarness()
    port = harness.ports[0]
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port + BUS_OFFSET))
        squatter.listen()
        try:
            started = harness._start_new_node(port)
            assert started != port and started not in harness.ports[1:]
            assert harness.procs[started].alive() and port not in harness.procs
            assert harness.cli(started, "ping") == "PONG"
        finally:
            harness.stop()
