"""``bench.floor``, the relay ``bench instructions --floor`` counts: run by its own command (real
uvicorn, real aiohttp) in front of a loopback node, it passes the chat and the answer through
unchanged and serves nothing else."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import ClassVar

import httpx
import pytest

from prefixgate.bench import floor
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import Handler, free_port, serve_http

ANSWER = b'{"id":"chatcmpl-1","object":"chat.completion","choices":[]}'


class Node(Handler):
    """A node that keeps what it was sent and answers ``ANSWER``."""

    seen: ClassVar[list[tuple[str, bytes]]] = []
    lock: ClassVar[threading.Lock] = threading.Lock()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        with self.lock:
            self.seen.append((self.path, body))
        self.reply(200, ANSWER)


@pytest.fixture
def relay() -> Iterator[str]:
    Node.seen = []
    with serve_http(Node) as node:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        child: Child = processes.start(
            "floor",
            floor.command(port),
            ready=processes.answers_http(url + "/readyz"),
            timeout=30.0,
            env={floor.NODE_ENV: node},
        )
        try:
            yield url
        finally:
            processes.stop_all([child], grace=5.0)


def test_a_chat_and_its_answer_pass_through_unchanged(relay: str) -> None:
    chat = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
    r = httpx.post(relay + "/v1/chat/completions", content=chat, timeout=10.0)
    assert r.status_code == 200 and r.content == ANSWER
    assert r.headers["content-type"] == "application/json"
    assert Node.seen == [("/v1/chat/completions", chat)]


def test_anything_else_is_not_found_and_not_relayed(relay: str) -> None:
    assert httpx.get(relay + "/v1/models", timeout=10.0).status_code == 404
    assert httpx.post(relay + "/v1/completions", content=b"{}", timeout=10.0).status_code == 404
    assert Node.seen == []
