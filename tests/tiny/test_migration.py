"""Migration end to end on the tiny engine: a decode node SIGKILLed mid-stream, its greedy
streams continue on the other decode node token for token as the unbroken ones (text, log
probabilities, finish, usage), the client seeing no break (docs/faults.md, After the first token).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.faults.cluster import Cluster, NodeProc
from tests.faults.drills import restart
from tests.tiny.support import BS, SMALL

MAX_TOKENS = 1500  # a second or more of decoding: the kill lands mid-stream


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """1 prefill + 2 decode tiny nodes (16-token blocks, the gateway's too)."""
    c = Cluster.create(
        1, 2, ["--engine", SMALL, "--block-size", str(BS)], gateway_env={"PREFIXGATE_BLOCK_SIZE": str(BS)}
    )
    c.start()
    try:
        yield c
    finally:
        assert c.stop() == 0


def _body(i: int) -> dict[str, Any]:
    return {
        "model": "prefixgate-sim",
        "messages": [{"role": "user", "content": f"story {i}: tell me about prefix caches and pages"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _stream(
    http: httpx.AsyncClient, body: dict[str, Any], on_first: Any = None
) -> tuple[str, list[tuple[str, float]], str, dict[str, Any], list[str]]:
    """(text, (token, logprob) per token, finish, usage, raw events) of one streamed request;
    ``on_first(decode node)`` once the first content chunk is in."""
    text, lps, finish, usage, events = "", [], "", {}, []
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        node = r.headers["x-prefixgate-decode-node"]
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line == "data: [DONE]":
                break
            ev = orjson.loads(line[6:])
            assert "error" not in ev, ev
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev["choices"]:
                piece = ch["delta"].get("content") or ""
                if piece and not text and on_first is not None:
                    on_first(node)
                text += piece
                lps += [(e["token"], e["logprob"]) for e in (ch.get("logprobs") or {}).get("content") or []]
                finish = ch["finish_reason"] or finish
    return text, lps, finish, usage, events


def test_migrated_greedy_streams_equal_the_unbroken_ones(cluster: Cluster) -> None:
    killed: list[NodeProc] = []

    def kill(node_id: str) -> None:
        if not killed:
            victim = next(n for n in cluster.decode if n.gateway_id == node_id)
            victim.kill()
            killed.append(victim)

    async def run(bodies: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            unbroken = [await _stream(http, b) for b in bodies]
            broken = await asyncio.gather(*(_stream(http, b, kill) for b in bodies))
            return unbroken, list(broken)

    # The tiny engine decodes fast: on a loaded machine a node may have sent its whole answer by
    # the time the client reads the first token and the kill lands. Up to 3 rounds until one
    # breaks a stream; every round's streams must equal the unbroken ones all the same.
    migrations = 0.0
    for round_ in range(3):
        killed.clear()
        migrations0 = cluster.metric("prefixgate_migrations_total")
        unbroken, broken = asyncio.run(run([_body(round_ * 3 + i) for i in range(3)]))
        migrations = cluster.metric("prefixgate_migrations_total") - migrations0
        _equal(unbroken, broken)
        assert killed
        restart(cluster, killed[0])
        if migrations >= 1:
            break
    assert migrations >= 1, migrations


def _equal(unbroken: list[Any], broken: list[Any]) -> None:
    for want, got in zip(unbroken, broken, strict=True):
        text, lps, finish, usage, events = got
        assert events[-1] == "[DONE]"
        assert len(want[1]) == want[3]["completion_tokens"] > 100  # long enough to break mid-way
        assert [t for t, _ in lps] == [t for t, _ in want[1]]  # token for token
        # the log probabilities continue (float32: a cached prefix's differ in the last bits)
        assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(lps, want[1], strict=True))
        assert (text, finish) == (want[0], want[2])
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            want[3]["prompt_tokens"],
            want[3]["completion_tokens"],
        )
