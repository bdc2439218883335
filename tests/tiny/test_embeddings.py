"""``/v1/embeddings`` end to end with the ``openai`` client: the tiny engine's embeddings (its
last layer's hidden states, normalized and mean-pooled) through the gateway equal the node's own
answer, vector for vector, for one input, a batch, token ids and base64; bad requests are
refused in OpenAI's format; an engine without embeddings says so.

Behind the gateway: two tiny-engine nodes' OpenAI-compatible HTTP endpoints
(``--worker-urls``), and a simulated one serving another model.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from openai import OpenAI

from prefixgate.backends.tiny.config import PRESETS
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import free_port, spawn
from tests.httpworkers.conftest import wait_models

MODEL, SIM_MODEL = "m-embed", "m-sim"
WIDTH = PRESETS["default"].d_model


@dataclass
class Stack:
    base: str
    nodes: list[str]  # the tiny nodes' own URLs

    def client(self, url: str) -> OpenAI:
        return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _node(model: str, engine: str) -> tuple[Child, str]:
    proc, http_url, _grpc = _node_both(model, engine)
    return proc, http_url


def _node_both(model: str, engine: str) -> tuple[Child, str, str]:
    """The node, its HTTP endpoint's URL and its gRPC address (both protocols on one port)."""
    http = ["--http-port", "0", "--http-model", model]
    proc = spawn(["node", "--role", "monolithic", "--port", "0", *http, "--engine", engine, "--ready-line"])
    m = proc.wait_for(r'^\{"event": "node_ready".*"http_address".*\}$', timeout=120)
    ready = json.loads(m.group(0))
    return proc, f"http://{ready['http_address']}", str(ready["address"])


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Child] = []
    try:
        urls = []
        for model, engine in ((MODEL, "tiny"), (MODEL, "tiny"), (SIM_MODEL, "sim")):
            proc, url = _node(model, engine)
            procs.append(proc)
            urls.append(url)
        port = free_port()
        procs.append(spawn(["gateway", "--port", str(port), "--worker-urls", *urls]))
        base = f"http://127.0.0.1:{port}"
        wait_models(base, {MODEL, SIM_MODEL}, timeout=60)
        yield Stack(base, urls[:2])
    finally:
        processes.stop_all(reversed(procs))


def test_one_input_through_the_gateway_equals_the_nodes_own(stack: Stack) -> None:
    via = stack.client(stack.base).embeddings.create(model=MODEL, input="prefix caches and KV pages")
    direct = stack.client(stack.nodes[0]).embeddings.create(model=MODEL, input="prefix caches and KV pages")
    assert len(via.data) == 1 and len(via.data[0].embedding) == WIDTH
    assert via.data[0].embedding == direct.data[0].embedding
    assert abs(sum(v * v for v in via.data[0].embedding) - 1.0) < 1e-4  # unit length
    assert via.usage.prompt_tokens == direct.usage.prompt_tokens > 0
    assert via.model == MODEL


def test_a_batch_keeps_its_order_and_each_vector(stack: Stack) -> None:
    texts = ["alpha", "a longer second text about routing", "gamma " * 50]
    via = stack.client(stack.base).embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in via.data] == [0, 1, 2]
    for text, got in zip(texts, via.data, strict=True):
        one = stack.client(stack.nodes[1]).embeddings.create(model=MODEL, input=text)
        assert got.embedding == one.data[0].embedding
    assert via.data[0].embedding != via.data[1].embedding


def test_token_ids_and_base64(stack: Stack) -> None:
    client = stack.client(stack.base)
    ids = client.embeddings.create(model=MODEL, input=[[1, 2, 3, 4], [5, 6]])
    assert [len(d.embedding) for d in ids.data] == [WIDTH, WIDTH] and ids.usage.prompt_tokens == 6
    as_float = client.embeddings.create(model=MODEL, input="encode me", encoding_format="float")
    raw = httpx.post(
        stack.base + "/v1/embeddings",
        json={"model": MODEL, "input": "encode me", "encoding_format": "base64"},
        timeout=30,
        trust_env=False,
    )
    assert raw.status_code == 200, raw.text
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    decoded = list(struct.unpack(f"<{WIDTH}f", packed))
    assert decoded == pytest.approx(as_float.data[0].embedding, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL}, 400, "input"),
        ({"model": MODEL, "input": ""}, 400, "input"),
        ({"model": MODEL, "input": [1, "a"]}, 400, "input"),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"model": MODEL, "input": "x", "dimensions": 7}, 400, "dimensions"),  # the node's answer, passed on
        ({"model": MODEL, "input": "x", "bogus": 1}, 400, "bogus"),
        ({"model": "nope", "input": "x"}, 404, "model"),
        ({"model": SIM_MODEL, "input": "x"}, 400, "model"),  # the simulated engine has none
    ],
)
def test_bad_requests_are_refused_in_openais_format(
    stack: Stack, body: dict[str, object], status: int, param: str
) -> None:
    r = httpx.post(stack.base + "/v1/embeddings", json=body, timeout=30, trust_env=False)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] and err["message"], err


def test_the_openai_client_sees_an_error_as_such(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError):
        stack.client(stack.base).embeddings.create(model=MODEL, input="x", dimensions=3)


def test_over_the_smg_protocol_the_engines_embed_call_serves_them() -> None:
    """A ``grpc://`` worker: the gateway tokenizes with the engine's tokenizer and asks its
    ``Embed`` call; the vectors equal the node's own HTTP answer for the same texts."""
    procs: list[Child] = []
    try:
        proc, http_url, grpc_address = _node_both(MODEL, "tiny")
        procs.append(proc)
        port = free_port()
        procs.append(spawn(["gateway", "--port", str(port), "--worker-urls", f"grpc://{grpc_address}"]))
        base = f"http://127.0.0.1:{port}"
        procs[-1].wait_until(processes.answers_http(base + "/readyz"), 60)
        served = httpx.get(base + "/v1/models", timeout=10, trust_env=False).json()["data"]
        assert len(served) == 1, served  # the engine's own model name, as its GetModelInfo gives it
        model = served[0]["id"]
        texts = ["alpha beta", "a second, longer text about prefix caches"]
        via = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60).embeddings.create(
            model=model, input=texts
        )
        direct = OpenAI(
            base_url=http_url + "/v1", api_key="unused", max_retries=0, timeout=60
        ).embeddings.create(model=MODEL, input=texts)
        assert [len(d.embedding) for d in via.data] == [WIDTH, WIDTH]
        for got, want in zip(via.data, direct.data, strict=True):
            assert got.embedding == pytest.approx(want.embedding, rel=1e-6, abs=1e-7)
        assert via.usage.prompt_tokens == direct.usage.prompt_tokens
    finally:
        processes.stop_all(reversed(procs))
