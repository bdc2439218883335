"""One running stack (``prefixgate up``) shared by the end-to-end tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from openai import OpenAI

from prefixgate.gateway.ops.processes import Child
from tests.helpers import free_port, spawn

MODEL = "prefixgate-sim"


@dataclass
class Stack:
    base_url: str
    proc: Child
    ready_s: float

    def client(self, **kw: object) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60, **kw)  # type: ignore[arg-type]

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.root, timeout=30)


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    port = free_port()
    t0 = time.perf_counter()
    proc = spawn(["up", "--port", str(port), "--time-scale", "0.05", "--capacity-blocks", "4096"])
    try:
        m = proc.wait_for(r"prefixgate ready in [0-9.]+s: (http://\S+/v1)", timeout=60)
        ready = time.perf_counter() - t0
        yield Stack(m.group(1), proc, ready)
    finally:
        rc = proc.stop()
        assert rc == 0, f"prefixgate up exited with {rc}:\n" + "\n".join(list(proc.lines)[-30:])
