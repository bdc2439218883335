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


def test_a_gateway_without_http_workers_loads_no_http_client_nor_numpy() -> None:
    """The HTTP adapter's client (aiohttp) and the SMG prompt's numpy are a fifth of a gateway's
    start; every gateway worker and replica pays it. They load with the first such worker."""
    probe = (
        "import sys\n"
        "import prefixgate.gateway.ops.server, prefixgate.gateway.httpfront.app\n"
        "from prefixgate.gateway.nodeclient import connect\n"
        "connect('127.0.0.1:1')\n"
        "before = sorted({m.split('.')[0] for m in sys.modules} & {'aiohttp', 'numpy'})\n"
        "connect('http://127.0.0.1:1')\n"
        "print(before, 'aiohttp' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[] True"
