"""An engine's refusal becomes the client's 400 with the engine's words, bounded and scrubbed."""

from __future__ import annotations

import pytest

from prefixgate.gateway.core.refusals import MAX_MESSAGE, refusal
from prefixgate.gateway.nodeclient import NodeFailure
from prefixgate.gateway.vocab import FailureKind, Stage


@pytest.mark.parametrize(
    "detail",
    [
        "INVALID_ARGUMENT: The input (9000 tokens) is longer than the model's context length (8192 tokens).",
        "HTTP 400: This model's maximum context length is 4096 tokens. However, you requested 5000 tokens.",
        "INVALID_ARGUMENT: The decoder prompt (length 9000) is longer than the maximum model length of 8192.",
        "INVALID_ARGUMENT: prompt has 640 tokens, the context holds 128",
    ],
)
def test_context_overflows_carry_the_code(detail: str) -> None:
    e = refusal(NodeFailure("grpc://10.0.0.7:30000", Stage.GENERATE, FailureKind.INVALID, detail))
    assert e is not None and e.code == "context_length_exceeded"
    assert "INVALID_ARGUMENT" not in e.message and "HTTP 400" not in e.message


def test_other_refusals_are_plain_400s_without_addresses() -> None:
    detail = "INVALID_ARGUMENT: bad logit_bias from 10.1.2.3:8000 via http://node-7.internal:9000/x "
    detail += "y" * 900
    e = refusal(NodeFailure("n", Stage.PREFILL, FailureKind.INVALID, detail))
    assert e is not None and e.code == "invalid_request"
    assert "10.1.2.3" not in e.message and "node-7" not in e.message and "bad logit_bias" in e.message
    assert len(e.message) <= MAX_MESSAGE + 64


def test_only_refusals_of_the_request_count() -> None:
    assert refusal(NodeFailure("n", Stage.GENERATE, FailureKind.UNAVAILABLE, "down")) is None
    assert refusal(NodeFailure("n", Stage.CACHE, FailureKind.INVALID, "only a whole-node flush")) is None
