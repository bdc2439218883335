"""``free_port``: what tests, benchmarks and ``prefixgate up`` start children on. Two test workers
once chose the same port: the second gateway could not bind it, and its tests ran against the
first one's gateway."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefixgate.gateway.ops import stack
from prefixgate.gateway.ops.stack import port_range

CHOOSE = """
import sys
from prefixgate.gateway.ops.stack import free_port
print(" ".join(str(free_port()) for _ in range(int(sys.argv[1]))))
"""
PER_PROCESS = 300  # from ~12,700 ports: two processes choosing at random alone share some


def test_ports_lie_below_the_kernels_ephemeral_range() -> None:
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = port_range()
    assert len(ports) >= 1_000 and ports[-1] < ephemeral_low


def test_processes_choosing_at_once_never_get_one_port() -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", CHOOSE, str(PER_PROCESS)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    chosen = [[int(p) for p in proc.communicate(timeout=60)[0].split()] for proc in procs]
    assert all(len(c) == PER_PROCESS for c in chosen)
    every = [p for c in chosen for p in c]
    assert len(set(every)) == len(every)
    assert all(p in port_range() for p in every)


def test_without_a_registry_it_still_hands_out_fresh_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stack, "_REGISTRY", tmp_path)  # a directory: the registry cannot be opened
    chosen = [stack.free_port() for _ in range(50)]
    assert len(set(chosen)) == len(chosen)  # this process's own choices are still kept
