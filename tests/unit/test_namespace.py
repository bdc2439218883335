"""The installed distribution is one namespace: ``prefixgate.*``, nothing else at the top level."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def test_only_prefixgate_is_importable_outside_the_checkout(tmp_path: Path) -> None:
    for name in ("gateway", "backends", "bench", "cachetier"):
        r = _python(f"import {name}", tmp_path)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (name, r.stderr)
    r = _python(
        "import prefixgate.cli, prefixgate.gateway.httpfront.app, prefixgate.backends.node, "
        "prefixgate.cachetier.index, prefixgate.bench.replay, prefixgate.v1.node_pb2",
        tmp_path,
    )
    assert r.returncode == 0, r.stderr


def test_the_distribution_declares_one_top_level_package() -> None:
    dist = importlib.metadata.distribution("prefixgate")
    top = (dist.read_text("top_level.txt") or "").split()
    assert top == ["prefixgate"], top
    scripts = [ep for ep in dist.entry_points if ep.group == "console_scripts"]
    assert [(ep.name, ep.value) for ep in scripts] == [("prefixgate", "prefixgate.cli:main")]


def test_the_console_script_runs(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("prefixgate")
    path = str(exe) if exe.exists() else shutil.which("prefixgate")
    assert path is not None
    r = subprocess.run([path, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "node" in r.stdout and "bench" in r.stdout, r.stderr
