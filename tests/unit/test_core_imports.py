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


def printed(probe: str) -> list[str]:
    """What ``probe`` prints run in a fresh interpreter, word by word."""
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return out.stdout.split()


def test_the_core_imports_no_web_framework() -> None:
    probe = (
        f"import sys\nfor m in {CORE!r}: __import__(m)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'starlette', 'uvicorn', 'fastapi'}))"
    )
    assert printed(probe) == ["[]"]


def test_a_gateway_loads_no_client_it_has_no_worker_for() -> None:
    """aiohttp (HTTP workers), numpy (prompts to grpc:// workers) and httpx (Kubernetes discovery)
    are a fifth of a gateway's start, which every gateway worker and replica pays: each loads with
    its first use, not before."""
    probe = (
        "import sys\n"
        "import prefixgate.gateway.ops.server, prefixgate.gateway.httpfront.app\n"
        "from prefixgate.gateway.nodeclient import connect\n"
        "connect('127.0.0.1:1'), connect('grpc://127.0.0.1:1')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'aiohttp', 'numpy', 'httpx'}))\n"
        "connect('http://127.0.0.1:1')\n"
        "print('aiohttp' in sys.modules)"
    )
    assert printed(probe) == ["[]", "True"]


def test_structlog_is_imported_without_rich_and_rich_stays_importable() -> None:
    probe = (
        "import sys, prefixgate, structlog\n"
        "print(structlog.dev.rich is None, 'rich' in sys.modules)\n"
        "from rich.table import Table\n"
        "print('rich' in sys.modules)"
    )
    assert printed(probe) == ["True", "False", "True"]
