"""Shared helpers for tests that run real processes on loopback."""

from __future__ import annotations

import http.server
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefixgate.bench import drill_cluster
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from prefixgate.gateway.ops.stack import free_port as free_port

REPO = Path(__file__).resolve().parent.parent


def spawn(args: list[str], env: dict[str, str] | None = None, open_files: int = 0) -> Child:
    """``prefixgate ARGS`` as a child, logging JSON, run from the checkout; ``open_files`` > 0:
    its RLIMIT_NOFILE."""
    return drill_cluster.spawn(args, env, open_files, cwd=REPO)


WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()


def document(seed: int, tokens: int) -> str:
    """Deterministic prose of about ``tokens`` tokens (the bytes4 tokenizer: 4 bytes a token)."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def wait_answered(base: str, proc: Child, model: str, *, timeout: float = 60.0) -> None:
    """Until a one-token chat through the gateway or router at ``base`` is answered (it is up and
    routes to a worker), or raise with the tail of its output (it exited or never routed)."""
    proc.wait_until(processes.routes_chat(base, model), timeout, f"routing to {base}")


class Handler(http.server.BaseHTTPRequestHandler):
    """A loopback test server's handler: ``reply`` sends a whole body; nothing is logged."""

    def reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serve_http(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server for ``handler`` on a free loopback port (a thread per request), its base
    URL; stopped, its requests left to end, when the block ends."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
