"""The gRPC request -> OpenAI body mapping and the domain error -> gRPC code mapping (pure)."""

from __future__ import annotations

import grpc

from prefixgate.gateway.grpcfront.servicer import request_body, status_of
from prefixgate.openai.exceptions import (
    Conflict,
    DeadlineExceeded,
    Draining,
    Forbidden,
    GatewayError,
    InvalidRequest,
    NotFound,
    Overloaded,
    QuotaExceeded,
    StreamBroken,
    TooLarge,
    Unauthenticated,
    Unavailable,
)
from prefixgate.v1 import gateway_pb2


def test_chat_request_maps_every_field() -> None:
    req = gateway_pb2.CompletionRequest(
        model="m",
        messages=[gateway_pb2.ChatMessage(role="user", content="hi", name="ann")],
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        seed=42,
        stop=["\n"],
        user="u1",
        documents=[gateway_pb2.Document(id="a", text="A"), gateway_pb2.Document(text="B")],
        document_ids=["reg"],
        tools_json='[{"type": "function", "function": {"name": "f"}}]',
    )
    body, kind = request_body(req)
    assert kind == "chat"
    assert body == {
        "model": "m",
        "max_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 42,
        "stop": ["\n"],
        "user": "u1",
        "documents": [{"id": "a", "text": "A"}, {"id": None, "text": "B"}],
        "document_ids": ["reg"],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "messages": [{"role": "user", "content": "hi", "name": "ann"}],
    }


def test_unset_optional_fields_stay_unset() -> None:
    body, kind = request_body(gateway_pb2.CompletionRequest(model="m", prompt="p"))
    assert kind == "completion" and body == {"model": "m", "prompt": "p"}
    body, _ = request_body(gateway_pb2.CompletionRequest(model="m", prompt="p", temperature=0.0, seed=0))
    assert body["temperature"] == 0.0 and body["seed"] == 0


def test_status_codes() -> None:
    expected: list[tuple[GatewayError, grpc.StatusCode]] = [
        (InvalidRequest("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (TooLarge("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED),
        (Forbidden("x"), grpc.StatusCode.PERMISSION_DENIED),
        (NotFound("x"), grpc.StatusCode.NOT_FOUND),
        (Conflict("x"), grpc.StatusCode.ALREADY_EXISTS),
        (QuotaExceeded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Overloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (StreamBroken("x"), grpc.StatusCode.UNAVAILABLE),
        (Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (Draining("x"), grpc.StatusCode.UNAVAILABLE),
        (DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (GatewayError("x"), grpc.StatusCode.INTERNAL),
    ]
    for err, code in expected:
        assert status_of(err) == code, err
