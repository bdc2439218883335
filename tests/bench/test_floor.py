"""``bench.floor``, the relays ``bench instructions --floor`` counts and ``bench overhead
--floor`` times, each run by its own command (real uvicorn, real aiohttp) in front of a loopback
node: the floor passes the chat and the answer (whole or streamed) through unchanged and serves
nothing else; the essentials check the chat, remember its blocks, give the answer (every event
of a stream) its id and log the request."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import httpx
import pytest

from prefixgate.bench import floor
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import Handler, free_port, serve_http

ANSWER = b'{"id":"chatcmpl-1","object":"chat.completion","choices":[]}'
# a streamed answer as a node sends it: two events, one split across writes, then [DONE]
EVENTS = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[],',
    b'"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\ndata: [DONE]\n\n',
)


class Node(Handler):
    """A node that keeps what it was sent and answers ``ANSWER``."""

    seen: ClassVar[list[tuple[str, bytes]]] = []
    lock: ClassVar[threading.Lock] = threading.Lock()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        with self.lock:
            self.seen.append((self.path, body))
        if not json.loads(body).get("stream"):
            self.reply(200, ANSWER)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for part in (*EVENTS, b""):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()


@contextmanager
def running(factory: str) -> Iterator[tuple[str, Child]]:
    """``bench.floor`` 's ``factory`` by its own command in front of a fresh ``Node``: its URL
    and process."""
    Node.seen = []
    with serve_http(Node) as node:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        child = processes.start(
            factory,
            floor.command(port, factory=factory),
            ready=processes.answers_http(url + "/readyz"),
            timeout=30.0,
            env={floor.NODE_ENV: node},
        )
        try:
            yield url, child
        finally:
            processes.stop_all([child], grace=5.0)


@pytest.fixture
def relay() -> Iterator[str]:
    with running("app") as (url, _):
        yield url


@pytest.fixture
def essentials() -> Iterator[tuple[str, Child]]:
    with running("essentials") as started:
        yield started


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


def test_the_essentials_check_the_chat_remember_its_blocks_and_log_it(essentials: tuple[str, Child]) -> None:
    url, child = essentials
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 2048}], "max_tokens": 8}
    first = httpx.post(url + "/v1/chat/completions", json=chat, timeout=10.0)
    again = httpx.post(url + "/v1/chat/completions", json=chat, timeout=10.0)
    assert first.status_code == again.status_code == 200
    assert first.json()["object"] == "chat.completion" and first.json()["id"] != again.json()["id"]
    assert [json.loads(body) for _, body in Node.seen] == [chat, chat]
    bad = {"model": "m", "messages": [{"role": "robot", "content": "hi"}]}
    assert httpx.post(url + "/v1/chat/completions", json=bad, timeout=10.0).status_code == 400
    assert httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=10.0).status_code == 400
    assert len(Node.seen) == 2  # not relayed

    def logged() -> list[dict[str, object]]:
        return [json.loads(line) for line in child.lines if line.startswith('{"event":"request"')]

    child.wait_until(lambda _: len(logged()) == 2, 10.0, "two request lines")
    # the second sees the first's blocks in the index: 2 KB of text is 8 whole blocks
    assert [line["cached_blocks"] for line in logged()] == [0, 8]


def _events(body: bytes) -> list[bytes]:
    return [line for line in body.split(b"\n") if line]


def test_a_stream_passes_through_the_floor_unchanged(relay: str) -> None:
    chat = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    r = httpx.post(relay + "/v1/chat/completions", content=chat, timeout=10.0)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content == b"".join(EVENTS)


def test_the_essentials_give_every_event_of_a_stream_the_answer_id(essentials: tuple[str, Child]) -> None:
    url, child = essentials
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=10.0)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.content)
    assert events[-1] == b"data: [DONE]" and len(events) == 3
    ids = {json.loads(e.removeprefix(b"data: "))["id"] for e in events[:-1]}
    assert len(ids) == 1 and ids != {"chatcmpl-1"}
    assert json.loads(events[1].removeprefix(b"data: "))["usage"]["prompt_tokens"] == 5

    def logged() -> list[dict[str, object]]:
        return [json.loads(line) for line in child.lines if line.startswith('{"event":"request"')]

    child.wait_until(lambda _: len(logged()) == 1, 10.0, "the request line")
    assert logged()[0]["prompt_tokens"] == 5  # from the stream's usage event
