"""Real OpenAI-compatible HTTP workers on loopback behind one real gateway (``--worker-urls``).

Workers: our own nodes' HTTP endpoint (``prefixgate node ... --http-port``), two serving model
``m-a`` and one ``m-b``; and, when it can run here, a third-party mock OpenAI-compatible worker
(``mock_worker.py`` from the peer-router kit: ``$PREFIXGATE_MOCK_WORKER``, default
``../shared/peers/mock_worker.py`` next to the checkout; run where it is under this interpreter,
the dev extras carrying what it imports) serving ``m-c``. The gateway is
``prefixgate gateway --worker-urls ...`` with every worker, its ``--model`` left at the default
(which no worker serves: the models come from the workers).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import REPO, free_port, spawn

NODE_BLOCK = 16
MOCK_SCRIPT = Path(
    os.environ.get("PREFIXGATE_MOCK_WORKER", REPO.parent / "shared" / "peers" / "mock_worker.py")
)
MOCK_PYTHON = Path(sys.executable)  # aiohttp, orjson, uvloop, httpx: all dependencies of the package


@dataclass
class Worker:
    model: str
    url: str
    proc: Child | None = None

    @property
    def node_id(self) -> str:
        return self.url.removeprefix("http://")

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10, trust_env=False)


@dataclass
class Cluster:
    base: str
    gateway: Child
    workers: list[Worker]
    mock: Worker | None = None
    procs: list[Child] = field(default_factory=list)
    grpc_port: int = 0

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=60)

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=30, trust_env=False)

    def of(self, model: str) -> list[Worker]:
        return [w for w in self.all if w.model == model]

    @property
    def all(self) -> list[Worker]:
        return self.workers + ([self.mock] if self.mock else [])


def start_node(model: str, time_scale: float = 0.05) -> Worker:
    proc = spawn(
        [
            "node",
            "--role",
            "monolithic",
            "--port",
            "0",
            "--http-port",
            "0",
            "--http-model",
            model,
            "--block-size",
            str(NODE_BLOCK),
            "--time-scale",
            str(time_scale),
            "--ready-line",
        ]
    )
    m = proc.wait_for(r'^\{"event": "node_ready".*"http_address".*\}$', timeout=60)
    ready = json.loads(m.group(0))
    return Worker(model, f"http://{ready['http_address']}", proc)


def start_mock(model: str) -> Worker | None:
    """The peers' mock worker, or None with the reason printed when it cannot run here."""
    missing = [str(p) for p in (MOCK_SCRIPT, MOCK_PYTHON) if not p.exists()]
    if missing:
        reason = f"mock worker not run: missing {', '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        print(reason, file=sys.stderr)
        return None
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        str(MOCK_PYTHON),
        str(MOCK_SCRIPT),
        "--ports",
        str(port),
        "--model",
        model,
        "--tokens",
        "6",
        "--quiet",
    ]
    try:
        proc = processes.start("mock worker", argv, ready=processes.answers_http(url + "/health"), timeout=30)
    except processes.StartFailed as e:
        pytest.fail(f"the mock worker did not start on {url}: {e}")
    return Worker(model, url, proc)


def wait_models(base: str, want: set[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    got: set[str] = set()
    while time.monotonic() < deadline:
        try:
            r = httpx.get(base + "/v1/models", timeout=2, trust_env=False)
            got = {m["id"] for m in r.json()["data"]}
            ready = httpx.get(base + "/readyz", timeout=2, trust_env=False).status_code == 200
            if got == want and ready:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"gateway models {got} != {want} after {timeout}s")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    procs: list[Child] = []
    try:
        workers = []
        for model in ("m-a", "m-a", "m-b"):
            w = start_node(model)
            assert w.proc is not None
            procs.append(w.proc)
            workers.append(w)
        mock = start_mock("m-c")
        if mock is not None and mock.proc is not None:
            procs.append(mock.proc)
        port, grpc_port = free_port(), free_port()
        urls = [w.url for w in workers] + ([mock.url] if mock else [])
        # Above the workers' own max_tokens limit (8192): a request they refuse is possible.
        gateway = spawn(
            ["gateway", "--port", str(port), "--grpc-port", str(grpc_port), "--worker-urls", *urls],
            env={"PREFIXGATE_MAX_TOKENS_LIMIT": "9000"},
        )
        procs.append(gateway)
        base = f"http://127.0.0.1:{port}"
        wait_models(base, {"m-a", "m-b"} | ({"m-c"} if mock else set()))
        yield Cluster(base, gateway, workers, mock, procs, grpc_port)
    finally:
        processes.stop_all(reversed(procs))
