"""A stack with an admin token for the admin API, CLI, metrics and log tests (``prefixgate up``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from openai import OpenAI

from prefixgate.gateway.ops.processes import Child
from tests.helpers import free_port, spawn

MODEL = "prefixgate-sim"
ADMIN_TOKEN = "admin-secret-for-tests"


@dataclass
class AdminStack:
    base_url: str
    proc: Child

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60)

    def admin(self, token: str | None = ADMIN_TOKEN) -> httpx.Client:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.root, timeout=30, headers=headers)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.root, timeout=60)

    def log_lines(self) -> list[dict[str, Any]]:
        """The stack's JSON log lines so far (gateway and nodes)."""
        out = []
        for line in list(self.proc.lines):
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out


def start_stack(*args: str) -> tuple[str, Child]:
    proc = spawn(["up", "--port", str(free_port()), "--time-scale", "0.05", *args])
    try:
        m = proc.wait_for(r"prefixgate ready in [0-9.]+s: (http://\S+/v1)", timeout=60)
    except BaseException:
        proc.stop()
        raise
    return m.group(1), proc


def stop_stack(proc: Child) -> None:
    rc = proc.stop()
    assert rc == 0, f"prefixgate up exited with {rc}:\n" + "\n".join(list(proc.lines)[-30:])


@pytest.fixture(scope="session")
def stack() -> Iterator[AdminStack]:
    url, proc = start_stack(
        "--prefill", "2", "--decode", "2", "--capacity-blocks", "4096", "--admin-token", ADMIN_TOKEN
    )
    try:
        yield AdminStack(url, proc)
    finally:
        stop_stack(proc)


def chat(
    stack: AdminStack, messages: list[dict[str, str]], docs: list[dict[str, str]] | None = None, **extra: Any
) -> httpx.Response:
    """A plain chat completion over HTTP (headers and usage both matter in these tests)."""
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}
    if docs:
        body["documents"] = docs
    with stack.http() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def wait_until(check: Any, timeout: float = 5.0, interval: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy (bounded in time)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
