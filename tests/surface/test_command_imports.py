"""A command loads what it runs and not the rest: ``prefixgate node`` (started by the dozen in a
cluster) imports neither the gateway, the benchmarks, the admin client nor the Redis client, and
``prefixgate gateway`` not the benchmarks or the nodes' engines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

PROBE = """
import json, sys
from prefixgate.cli import build_parser, _command
argv = sys.argv[1:]
args = build_parser(_command(argv)).parse_args(argv)
if args.command == "node":
    import prefixgate.backends.node, prefixgate.backends.server, prefixgate.backends.smg_service
print(json.dumps(sorted(sys.modules)))
"""


def _modules(*argv: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=REPO, timeout=60, check=True
    )
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    ("argv", "absent"),
    [
        (
            ["node", "--role", "monolithic"],
            [
                "prefixgate.bench",
                "prefixgate.gateway.config",
                "prefixgate.gateway.ops.admin_cli",
                "redis",
                "starlette",
            ],
        ),
        (["gateway", "--monolithic", "127.0.0.1:1"], ["prefixgate.bench", "prefixgate.backends.node"]),
    ],
)
def test_a_command_imports_what_it_runs(argv: list[str], absent: list[str]) -> None:
    loaded = _modules(*argv)
    assert any(m.startswith("prefixgate.") for m in loaded)
    for name in absent:
        assert not any(m == name or m.startswith(name + ".") for m in loaded), name


def test_the_help_still_names_every_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "prefixgate.cli", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 0
    for name in ("up", "gateway", "node", "bench", "admin"):
        assert f"    {name} " in out.stdout, out.stdout
