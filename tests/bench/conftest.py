"""Where the public traces are: ``$PREFIXGATE_TRACES`` or ``<repo>/../shared/traces``
(bench/README.md, "Traces")."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixgate.bench.workloads import DEFAULT_TRACES, traces_dir


def _trace(fmt: str) -> Path:
    path = traces_dir() / DEFAULT_TRACES[fmt]
    if not path.is_file():
        pytest.skip(f"trace not found at {path} (set PREFIXGATE_TRACES)")
    return path


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    return _trace("mooncake")


@pytest.fixture(scope="session")
def azure_trace() -> Path:
    return _trace("azure")
