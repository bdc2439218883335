"""The body an OpenAI-compatible worker gets (pure), and the worker status parsers."""

from __future__ import annotations

from typing import Any

import pytest

from prefixgate.gateway.nodeclient.http_openai import (
    HttpOpenAIClient,
    parse_get_load,
    parse_metrics,
    parse_models,
)
from prefixgate.gateway.nodeclient.openai_body import GATEWAY_FIELDS, engine_body, engine_messages
from prefixgate.openai.normalize import Document
from prefixgate.openai.schema import parse_request


def parsed(body: dict[str, Any], kind: str = "chat") -> Any:
    return parse_request(
        body, kind, models={"m"}, default_max_tokens=16, max_tokens_limit=1024, max_documents=8
    )


CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief.  \r\n"},
        {"role": "user", "content": [{"type": "text", "text": "hello  "}, {"type": "text", "text": "you"}]},
        {"role": "developer", "content": "No lists."},
        {"role": "assistant", "content": "hi\r\n"},
        {"role": "user", "content": "again"},
    ],
    "max_tokens": 7,
    "temperature": 0.3,
    "top_k": 5,
    "repetition_penalty": 1.1,
    "stream": False,
    "stream_options": {"include_usage": False},
    "documents": [{"id": "b", "text": "beta  "}, {"id": "a", "text": "alpha"}],
    "n": 1,
    "user": "u1",
}


def test_a_chat_is_normalized_and_the_clients_own_fields_passed_through() -> None:
    req = parsed(dict(CHAT))
    out = engine_body(req, req.documents, normalize=True, raw=CHAT)
    body = dict(out.body)
    assert out.kind == "chat"
    # The gateway's: the model, its length, always streamed with usage; its own fields dropped.
    assert body["model"] == "m" and body["max_tokens"] == 7
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert not (
        set(body) & (GATEWAY_FIELDS - {"model", "messages", "max_tokens", "stream", "stream_options"})
    )
    # The client's sampling, engine-specific knobs included, as sent.
    assert (body["temperature"], body["top_k"], body["repetition_penalty"], body["user"]) == (
        0.3,
        5,
        1.1,
        "u1",
    )
    system, *turns = body["messages"]
    assert system["role"] == "system"
    assert system["content"].startswith("Be brief.\n\nNo lists.\n\n<|documents|>\n")
    assert system["content"].index('id="a"') < system["content"].index('id="b"')  # canonical order
    assert "beta\n" in system["content"]  # document text cleaned
    assert turns == [
        {"role": "user", "content": "hello\nyou"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]


def test_the_same_meaning_reaches_the_engine_as_the_same_bytes() -> None:
    a = parsed(dict(CHAT))
    reordered = {**CHAT, "documents": list(reversed(CHAT["documents"]))}  # type: ignore[call-overload]
    b = parsed(reordered)
    assert (
        engine_body(a, a.documents, normalize=True, raw=CHAT).body["messages"]
        == engine_body(b, b.documents, normalize=True, raw=reordered).body["messages"]
    )


def test_without_normalization_the_messages_go_as_sent_after_the_documents() -> None:
    req = parsed(dict(CHAT))
    msgs = engine_messages(req.messages, req.documents, normalize=False)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("<|documents|>\n")
    assert msgs[1:] == CHAT["messages"]
    assert engine_messages(req.messages, [], normalize=False) == CHAT["messages"]


def test_without_a_client_body_the_parsed_sampling_is_sent() -> None:
    req = parsed(
        {"model": "m", "prompt": "say hi\r\n", "temperature": 0.5, "seed": 3, "stop": ["x"]}, "completion"
    )
    body = engine_body(req, [Document("d", "doc")], normalize=True).body
    assert (body["temperature"], body["top_p"], body["seed"], body["stop"]) == (0.5, 1.0, 3, ["x"])
    assert body["prompt"].startswith("<|documents|>") and body["prompt"].endswith("say hi\n")
    assert body["max_tokens"] == 16 and body["stream_options"] == {"include_usage": True}


def test_token_id_prompts_go_as_ids() -> None:
    req = parsed({"model": "m", "prompt": [1, 2, 3]}, "completion")
    assert engine_body(req, [], normalize=True).body["prompt"] == [1, 2, 3]


def test_status_parsers() -> None:
    assert parse_models(b'{"object":"list","data":[{"id":"a"},{"id":"b"},{"id":"a"},{"x":1}]}') == ("a", "b")
    with pytest.raises(ValueError):
        parse_models(b'{"detail":"nope"}')
    assert parse_get_load(b'[{"num_reqs":5,"num_waiting_reqs":2},{"num_reqs":1,"num_waiting_reqs":0}]') == (
        4,
        2,
    )
    assert parse_get_load(b'{"num_reqs":3,"num_waiting_reqs":1}') == (2, 1)
    with pytest.raises(ValueError):
        parse_get_load(b"[]")
    vllm = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        'vllm:prompt_tokens_total{model_name="m"} 12345.0\n'
    )
    assert parse_metrics(vllm) == (4, 2)
    sglang = 'sglang:num_running_reqs{model_name="m"} 7\nsglang:num_queue_reqs{model_name="m"} 1\n'
    assert parse_metrics(sglang) == (7, 1)
    with pytest.raises(ValueError):
        parse_metrics("process_cpu_seconds_total 1.0\n")


def test_worker_addresses() -> None:
    assert HttpOpenAIClient("http://127.0.0.1:8000").node_id == "127.0.0.1:8000"
    assert HttpOpenAIClient("http://[::1]:8000/v1/").node_id == "[::1]:8000"
    with pytest.raises(ValueError):
        HttpOpenAIClient("http://:8000")
