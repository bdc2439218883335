"""The core (service, runner, pipeline, cache operations) and its errors import no web framework:
the front ends map the core's errors and shape its results for their wire."""

from __future__ import annotations

import subprocess
import sys

CORE = (
    "prefixgate.gateway.core.errors",
    "prefixgate.gateway.core.service",
    "prefixgate.gateway.core.runner",
    "prefixgate.gateway.core.cache_ops",
    "prefixgate.openai.schema",
)


def test_the_core_imports_no_web_framework() -> None:
    probe = (
        f"import sys\nfor m in {CORE!r}: __import__(m)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'starlette', 'uvicorn', 'fastapi'}))"
    )
    argv = [sys.executable, "-c", probe]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
