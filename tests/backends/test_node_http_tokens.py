"""A node's HTTP endpoint gives its engine the ids its SMG gRPC face gets: the same chat, rendered
with the shipped tokenizer's chat template and tokenized with that tokenizer (what ``transformers``'
``apply_chat_template`` does, and so what smg or the gateway send over gRPC), has the same
``prompt_tokens`` and the same greedy text on both faces. Nodes run as processes, as peers see them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from transformers import AutoTokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.ops.processes import Child
from tests.helpers import spawn

HF = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
MODEL = "prefixgate-sim"
WORDS = "the cache keeps every block of the prompt it has seen and the router follows it".split()
USER = " ".join(WORDS[i % len(WORDS)] for i in range(100))  # 100 words
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": USER},
]


def start(*args: str) -> tuple[Child, dict[str, Any]]:
    p = spawn(
        ["node", "--role", "monolithic", "--port", "0", "--http-port", "0", "--log-level", "warning", *args]
    )
    try:
        m = p.wait_for(r'^(\{"event": "node_ready".*\})$', timeout=60)
    except BaseException:
        p.stop()
        raise
    return p, json.loads(m.group(1))


@pytest.fixture(scope="module", params=["sim", "tiny:preset=small"])
def node(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    p, ready = start("--engine", str(request.param))
    try:
        yield ready
    finally:
        p.stop(timeout=10)


def grpc_chat(address: str, max_new: int) -> tuple[int, str]:
    """(prompt_tokens, greedy text) over SglangScheduler, as smg sends a chat."""
    ids = HF.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    req = pb.GenerateRequest(
        request_id=f"grpc-{time.monotonic_ns()}",
        tokenized=pb.TokenizedInput(input_ids=list(ids)),
        sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new),
    )
    with grpc.insecure_channel(address) as ch:
        done = [m.complete for m in pb_grpc.SglangSchedulerStub(ch).Generate(req, timeout=30)][-1]
    assert done.prompt_tokens == len(ids)
    return done.prompt_tokens, str(HF.decode(list(done.output_ids), skip_special_tokens=True))


def test_http_and_grpc_give_the_engine_the_same_tokens(node: dict[str, Any]) -> None:
    base = f"http://{node['http_address']}"
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": MESSAGES[0]["content"]},
        {"role": "user", "content": USER},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    grpc_prompt, grpc_text = grpc_chat(str(node["address"]), 12)
    assert r.usage is not None and r.usage.completion_tokens == 12
    expected = HF.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == grpc_prompt == len(expected)
    assert r.choices[0].message.content == grpc_text and grpc_text

    with httpx.Client(base_url=base, timeout=10) as h:
        tok = h.post("/tokenize", json={"messages": MESSAGES}).json()
        rendered = h.post("/v1/chat/completions/render", json={"model": MODEL, "messages": MESSAGES}).json()
        text = h.post("/tokenize", json={"prompt": USER}).json()
        bad = h.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}
        )
    assert tok["tokens"] == rendered["token_ids"] == list(expected) and tok["count"] == len(expected)
    assert text["tokens"] == HF.encode(USER, add_special_tokens=False)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].role"

    # A completion prompt is tokenized as it is, with the same tokenizer.
    c = client.completions.create(model=MODEL, prompt=USER, max_tokens=2, temperature=0)
    assert c.usage is not None and c.usage.prompt_tokens == len(text["tokens"])
