"""Container health check for every prefixgate service: one image, one command.

The target comes from the first argument or ``PREFIXGATE_HEALTHCHECK``:

- ``http://HOST:PORT/PATH``: healthy when a GET answers 2xx (the gateway's ``/healthz``);
- ``grpc://HOST:PORT``: healthy when the standard ``grpc.health.v1.Health/Check`` says SERVING
  (every node and the gateway's gRPC front end serve it).

Exit code 0 = healthy, 1 = not, as Docker's HEALTHCHECK expects. Standard library plus grpcio
(already in the image), so a check costs one short-lived process and no extra packages.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from urllib.parse import urlsplit

DEFAULT_TARGET = "http://127.0.0.1:8000/healthz"
TIMEOUT_S = 2.0


def check_http(url: str, timeout: float = TIMEOUT_S) -> str | None:
    """None when healthy, else the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            status = int(resp.status)
    except (urllib.error.URLError, OSError) as e:
        return f"{url}: {e}"
    return None if 200 <= status < 300 else f"{url}: HTTP {status}"


def check_grpc(address: str, service: str = "", timeout: float = TIMEOUT_S) -> str | None:
    """None when the gRPC health service reports SERVING for ``service`` ("" = the server)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as e:
            return f"grpc://{address}: {e.code().name}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"grpc://{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def check(target: str) -> str | None:
    """Dispatch on the target's scheme; None when healthy, else the reason."""
    parts = urlsplit(target)
    if parts.scheme in ("http", "https"):
        return check_http(target)
    if parts.scheme == "grpc" and parts.netloc:
        return check_grpc(parts.netloc, parts.path.strip("/"))
    return f"unsupported health check target {target!r}: use http://HOST:PORT/PATH or grpc://HOST:PORT"


def main(argv: list[str]) -> int:
    target = argv[1] if len(argv) > 1 else os.environ.get("PREFIXGATE_HEALTHCHECK") or DEFAULT_TARGET
    reason = check(target)
    if reason is not None:
        print(f"unhealthy: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
