"""The gRPC front end with generated stubs: streaming, unary, errors, health, reflection, cancel."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prefixgate.v1 import gateway_pb2
from tests.admin.conftest import MODEL
from tests.grpc_front.conftest import GrpcStack
from tests.helpers import document


def _request(**kw: object) -> gateway_pb2.CompletionRequest:
    base: dict[str, object] = {
        "model": MODEL,
        "messages": [
            gateway_pb2.ChatMessage(role="system", content="Answer from the document."),
            gateway_pb2.ChatMessage(role="user", content="What does it say?"),
        ],
        "documents": [gateway_pb2.Document(id="grpc-doc", text=document(500, 1500))],
        "max_tokens": 8,
    }
    base.update(kw)
    return gateway_pb2.CompletionRequest(**base)  # type: ignore[arg-type]


def test_generate_streams_a_completion_and_complete_agrees(gstack: GrpcStack) -> None:
    stub = gstack.stub()
    call = stub.Generate(_request(), metadata=(("x-request-id", "grpc-rid-1"),), timeout=30)
    chunks = list(call)
    md = dict(call.initial_metadata())
    assert md["x-prefixgate-request-id"] == "grpc-rid-1"
    assert md["x-prefixgate-route"] == "disaggregated"
    assert call.code() == grpc.StatusCode.OK
    assert len(chunks) >= 2
    first, last = chunks[0], chunks[-1]
    assert first.id == "grpc-rid-1" and first.route == "disaggregated"
    assert first.prefill_node == "prefill-1" and first.decode_node == "decode-1"
    assert last.finish_reason in ("stop", "length") and all(not c.finish_reason for c in chunks[:-1])
    assert last.usage.prompt_tokens > 1500 and 0 < last.usage.completion_tokens <= 8
    text = "".join(c.text for c in chunks)
    assert text

    done = stub.Complete(_request(), timeout=30)
    assert done.text == text and done.finish_reason == last.finish_reason
    assert done.usage.prompt_tokens == last.usage.prompt_tokens
    assert done.usage.cached_tokens == (done.usage.prompt_tokens // 64) * 64  # the document was cached
    assert done.route == "disaggregated" and done.prefill_node == "prefill-1"

    # The same request over HTTP renders the same prompt.
    with gstack.admin() as http:
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": "What does it say?"},
            ],
            "documents": [{"id": "grpc-doc", "text": document(500, 1500)}],
            "max_tokens": 8,
        }
        r = http.post("/v1/chat/completions", json=body).json()
    assert r["usage"]["prompt_tokens"] == done.usage.prompt_tokens
    assert r["choices"][0]["message"]["content"] == done.text


def test_completion_form_and_sampling_fields(gstack: GrpcStack) -> None:
    req = gateway_pb2.CompletionRequest(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0.0, top_p=0.5, seed=7, stop=["zzz"]
    )
    done = gstack.stub().Complete(req, timeout=30)
    assert done.usage.completion_tokens <= 5 and done.text


@pytest.mark.parametrize(
    ("request_kw", "code", "words"),
    [
        ({"model": "no-such-model"}, grpc.StatusCode.NOT_FOUND, "does not exist"),
        ({"messages": [], "documents": [], "prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        ({"max_tokens": 100_000}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        ({"document_ids": ["missing"]}, grpc.StatusCode.NOT_FOUND, "not found"),
        ({"tools_json": "{nope"}, grpc.StatusCode.INVALID_ARGUMENT, "tools_json"),
        (
            {"messages": [gateway_pb2.ChatMessage(role="wizard", content="x")]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "role",
        ),
    ],
)
def test_invalid_requests_get_clear_status_codes(
    gstack: GrpcStack, request_kw: dict[str, object], code: grpc.StatusCode, words: str
) -> None:
    for rpc in ("Generate", "Complete"):
        with pytest.raises(grpc.RpcError) as info:
            call = getattr(gstack.stub(), rpc)(_request(**request_kw), timeout=30)
            if rpc == "Generate":
                list(call)
        err = info.value
        assert err.code() == code, (rpc, err.details())  # type: ignore[attr-defined]
        assert words in err.details()  # type: ignore[attr-defined]


def test_unavailable_when_no_node_can_serve(gstack: GrpcStack) -> None:
    with gstack.admin() as admin:
        try:
            for node in ("prefill-1", "decode-1"):
                assert admin.post(f"/admin/nodes/{node}/drain").status_code == 200
            with pytest.raises(grpc.RpcError) as info:
                gstack.stub().Complete(_request(), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            trailers = dict(info.value.trailing_metadata())  # type: ignore[attr-defined]
            assert trailers["x-prefixgate-error-code"] == "unavailable" and "retry-after" in trailers
        finally:
            for node in ("prefill-1", "decode-1"):
                admin.post(f"/admin/nodes/{node}/drain", json={"drain": False})
    assert gstack.stub().Complete(_request(), timeout=30).route == "disaggregated"


def test_health_and_reflection(gstack: GrpcStack) -> None:
    health = health_pb2_grpc.HealthStub(gstack.channel)
    for service in ("", "prefixgate.v1.Gateway"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    services = ProtoReflectionDescriptorDatabase(gstack.channel).get_services()
    assert "prefixgate.v1.Gateway" in services and "grpc.health.v1.Health" in services


def test_client_cancel_stops_the_work_on_the_nodes(gstack: GrpcStack) -> None:
    call = gstack.stub().Generate(_request(max_tokens=8000), timeout=60)  # ~40 s of decoding
    first = next(call)
    assert first.text or first.route
    with gstack.admin() as admin:

        def decode_streams() -> int:
            node = next(n for n in admin.get("/admin/nodes").json()["data"] if n["id"] == "decode-1")
            return int(node["load"]["active_streams"] + node["load"]["running_requests"])

        assert decode_streams() >= 1
        call.cancel()
        deadline = time.monotonic() + 5
        while decode_streams() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decode_streams() == 0, "the decode node still runs the cancelled request"
        metrics = admin.get("/metrics").text
    assert "prefixgate_inflight_requests 0.0" in metrics
