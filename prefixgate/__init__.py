"""prefixgate: an OpenAI-compatible gateway for disaggregated (prefill/decode) LLM serving.

Installed, the distribution is this one namespace: ``prefixgate.gateway``, ``prefixgate.cachetier``,
``prefixgate.backends``, ``prefixgate.bench``, ``prefixgate.v1`` (generated protobuf code) and
``prefixgate.cli`` (the command line, the one place that wires them together). In the source tree
each subpackage keeps its own top-level folder; the entries here are links to those folders, so a
checkout imports exactly the names an install does.
"""

import os as _os
import sys as _sys


def _structlog_without_rich() -> None:
    """Import structlog with ``rich`` out of its sight.

    structlog imports rich, when it is installed, to draw tracebacks in its console renderer.
    prefixgate's own lines have their exceptions made text before any renderer
    (``gateway.logging``); without rich, a standard-library logger's traceback in a terminal is
    printed as Python prints it. That import is half of structlog's: 0.1 s of CPU in every
    gateway, gateway worker, node and command at start. ``rich`` stays importable for what does
    use it (the tables of the admin and bench commands)."""
    if "structlog" in _sys.modules or "rich" in _sys.modules:
        return
    _sys.modules["rich"] = None  # type: ignore[assignment]  # "import rich" now fails at once
    try:
        import structlog  # noqa: F401
    finally:
        del _sys.modules["rich"]


_structlog_without_rich()


#: gRPC's client on its classic poller rather than its EventEngine (an experiment gRPC turns on
#: by default): a request to a ``grpc://`` worker then costs the gateway some 5-10 % less CPU at
#: one client (the EventEngine's own thread alone took 0.18 ms a request, docs/engines.md).
GRPC_EXPERIMENTS = "-event_engine_client"
#: The user's own ``GRPC_EXPERIMENTS`` (None: unset), for a program that starts another tree's
#: prefixgate as the user would (``bench`` 's baseline, which may predate this setting).
GRPC_EXPERIMENTS_GIVEN = _os.environ.get("GRPC_EXPERIMENTS")


def _grpc_client_poller() -> None:
    """Set ``GRPC_EXPERIMENTS`` for this process and its children unless the user set it:
    gRPC reads it once, when its core first asks, so it is set before any of it is imported."""
    _os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)


_grpc_client_poller()
