"""Context lengths route requests: node processes started with different ``--context-length``
behind one gateway, over our protocol, over ``grpc://`` (SMG, the context from GetModelInfo) and
as OpenAI-compatible HTTP workers (``/v1/models`` ``max_model_len``).

A prompt too long for the small node is served by the large one, every time; a prompt too long
for both is the client's 400 ``context_length_exceeded`` naming the largest context; a node
that refuses a prompt for length (the HTTP workers count more tokens than the gateway's estimate)
is retried around, and never blamed for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import free_port, spawn

SMALL, LARGE = 256, 1024  # the two nodes' --context-length
MODEL = "prefixgate-sim"


def _node(context: int, *extra: str) -> tuple[Child, dict[str, str]]:
    flags = ["--port", "0", "--ready-line", "--time-scale", "0", "--context-length", str(context)]
    proc = spawn(["node", "--role", "monolithic", *flags, *extra])
    m = proc.wait_for(processes.NODE_READY, timeout=60)
    return proc, json.loads(m.group(0))


@contextmanager
def _stack(scheme: str, *node_args: str) -> Iterator[tuple[str, list[str]]]:
    """Two nodes (SMALL, LARGE) and a gateway in front of them; yields its URL and the nodes'
    ids in the gateway (SMALL's first)."""
    procs: list[Child] = []
    try:
        urls: list[str] = []
        ids: list[str] = []
        for context in (SMALL, LARGE):
            proc, ready = _node(context, *node_args)
            procs.append(proc)
            address = ready["http_address"] if scheme == "http://" else ready["address"]
            urls.append(f"{scheme}{address}")
            # the gateway names a node by its own id, an SMG engine by its URL, a worker by its address
            ids.append({"": ready["node_id"], "grpc://": urls[-1]}.get(scheme, address))
        port = free_port()
        flags = ["--worker-urls", *urls] if scheme else [f for a in urls for f in ("--monolithic", a)]
        gateway = spawn(["gateway", "--port", str(port), *flags])
        procs.append(gateway)
        base = f"http://127.0.0.1:{port}"
        gateway.wait_until(processes.answers_http(base + "/readyz"), 60)
        yield base, ids
    finally:
        processes.stop_all(reversed(procs))


def _rows(base: str) -> dict[str, dict[str, object]]:
    nodes = httpx.get(base + "/admin/nodes", timeout=10).json()["data"]
    return {str(n["id"]): n for n in nodes}


@pytest.mark.parametrize("scheme", ["", "grpc://"])
def test_a_prompt_goes_to_a_node_whose_context_holds_it(scheme: str) -> None:
    with _stack(scheme) as (base, (small, large)):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        rows = _rows(base)
        assert rows[small]["max_context_tokens"] == SMALL and rows[large]["max_context_tokens"] == LARGE
        mid = "Prefix caches keep KV pages warm. " * 60  # more than SMALL tokens, fewer than LARGE
        served = set()
        for i in range(4):  # no cache to follow, ties alternate: each node would get its turn
            r = client.completions.with_raw_response.create(model=MODEL, prompt=f"{i}:{mid}", max_tokens=4)
            assert r.parse().choices[0].text
            served.add(r.headers["x-prefixgate-decode-node"])
        assert served == {large}
        explained = httpx.post(
            base + "/admin/cache/lookup", json={"prompt": mid, "max_tokens": 4}, timeout=10
        )
        fits = {n["id"]: (n["max_context_tokens"], n["holds_request"]) for n in explained.json()["nodes"]}
        assert fits == {small: (SMALL, False), large: (LARGE, True)}
        short = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert short.parse().choices[0].text
        # Without max_tokens, a prompt that leaves the large node less room than the gateway's
        # default (256) is served there, its answer no longer than the room left.
        ids = [10 + i % 200 for i in range(LARGE - 100)]
        near = client.completions.create(model=MODEL, prompt=ids)
        assert near.usage is not None and near.usage.prompt_tokens == LARGE - 100
        assert 0 < near.usage.completion_tokens <= 100
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=mid * 4, max_tokens=4)
        err = info.value
        assert err.code == "context_length_exceeded" and err.type == "invalid_request_error"
        assert "largest context available, 1024 tokens" in err.message
        assert err.body["param"] == "prompt"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as info:  # the prompt fits, max_tokens does not
            client.completions.create(model=MODEL, prompt=mid, max_tokens=LARGE)
        assert info.value.code == "context_length_exceeded"
        assert info.value.body["param"] == "max_tokens"  # type: ignore[index]
        rows = _rows(base)
        assert {rows[n]["circuit"] for n in (small, large)} == {"closed"}
        assert rows[small]["last_error"] is None  # never offered what it would refuse


def test_a_refusal_for_length_is_retried_on_a_node_that_holds_the_prompt() -> None:
    # HTTP workers tokenize themselves: "x," is 2 tokens to their tokenizer, half a token to the
    # gateway's estimate (bytes4), so the small worker is offered prompts it then refuses.
    with _stack("http://", "--http-port", "0", "--http-model", MODEL) as (base, (small, large)):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        for i in range(4):  # no cache to follow, ties alternate: each node is tried first
            prompt = f"{i}:" + "x," * 150  # ~75 tokens to the gateway, 300 to the workers: over SMALL
            r = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=4)
            assert r.parse().choices[0].text
            assert r.headers["x-prefixgate-decode-node"] == large
        rows = _rows(base)
        assert "the context holds 256" in str(rows[small]["last_error"])
        assert rows[small]["circuit"] == "closed"  # a refusal for length is no fault of the node
        with pytest.raises(openai.BadRequestError) as info:  # ~375 to the gateway, 1500 to both
            client.completions.create(model=MODEL, prompt="x," * 750, max_tokens=4)
        assert info.value.code == "context_length_exceeded"
        assert "largest context available, 1024 tokens" in info.value.message
        assert "the context holds 1024" in info.value.message  # the engine's own count: over it
