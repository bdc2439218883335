"""The committed generated protobuf code matches the .proto files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

GENERATED = REPO / "proto" / "prefixgate" / "v1"


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools (dev extra) is not installed")
    sys.path.insert(0, str(REPO / "proto"))
    try:
        from generate import generate  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    generate(tmp_path)
    fresh = sorted(p for p in (tmp_path / "prefixgate" / "v1").iterdir() if p.suffix in (".py", ".pyi"))
    assert fresh, "protoc produced nothing"
    for p in fresh:
        committed = GENERATED / p.name
        assert committed.exists(), f"{p.name} is not committed; run python proto/generate.py"
        assert committed.read_text() == p.read_text(), f"{p.name} is stale; run python proto/generate.py"
