"""Every prefixgate process runs gRPC's client on its classic poller unless the user chose
otherwise (``prefixgate/__init__.py``, docs/engines.md)."""

from __future__ import annotations

import os
import subprocess
import sys

_SHOW = "import prefixgate, os; print(os.environ.get('GRPC_EXPERIMENTS'))"


def _imported_with(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", _SHOW], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_prefixgate_turns_the_event_engine_client_off() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert _imported_with(env) == "-event_engine_client"


def test_a_users_own_grpc_experiments_are_kept() -> None:
    env = {**os.environ, "GRPC_EXPERIMENTS": "event_engine_client"}
    assert _imported_with(env) == "event_engine_client"
    assert _imported_with({**env, "GRPC_EXPERIMENTS": ""}) == ""
