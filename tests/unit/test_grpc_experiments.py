"""Every prefixgate process runs gRPC's client on its classic poller unless the user chose
otherwise (``prefixgate/__init__.py``, docs/engines.md)."""

from __future__ import annotations

import os
import subprocess
import sys

_SHOW = "import prefixgate, os; print(os.environ.get('GRPC_EXPERIMENTS'))"
# what a gateway the bench starts (its own tree's or a baseline's) is given
_GIVEN = "from prefixgate.bench import launch; print(launch.given_env().get('GRPC_EXPERIMENTS'))"


def _imported_with(env: dict[str, str], code: str = _SHOW) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_prefixgate_turns_the_event_engine_client_off() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert _imported_with(env) == "-event_engine_client"


def test_a_users_own_grpc_experiments_are_kept() -> None:
    env = {**os.environ, "GRPC_EXPERIMENTS": "event_engine_client"}
    assert _imported_with(env) == "event_engine_client"
    assert _imported_with({**env, "GRPC_EXPERIMENTS": ""}) == ""


def test_the_bench_gives_the_gateways_it_starts_the_users_own_setting() -> None:
    """A baseline tree from before the setting runs as it did; a newer one sets it itself."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert _imported_with(env, _GIVEN) == "None"
    assert _imported_with({**env, "GRPC_EXPERIMENTS": "-x"}, _GIVEN) == "-x"
