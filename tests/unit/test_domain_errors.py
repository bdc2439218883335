"""Domain errors map to one HTTP status each; subclasses keep their parent's unless mapped."""

from __future__ import annotations

import pytest

from prefixgate.gateway.core.errors import (
    DeadlineExceeded,
    Draining,
    GatewayError,
    InvalidRequest,
    NotFound,
    Overloaded,
    StreamBroken,
    Unavailable,
)
from prefixgate.gateway.vocab import FailureKind, Mode, Role
from prefixgate.openai.errors import from_domain, http_status


@pytest.mark.parametrize(
    ("err", "status", "code"),
    [
        (InvalidRequest("bad"), 400, "invalid_request"),
        (NotFound("no node"), 404, "not_found"),
        (Overloaded("full", retry_after=1), 429, "overloaded"),
        (Draining("bye"), 503, "shutting_down"),
        (Unavailable("none"), 503, "unavailable"),
        (DeadlineExceeded("late"), 504, "deadline_exceeded"),
        (StreamBroken("cut"), 502, "stream_broken"),
        (GatewayError("?"), 500, "internal_error"),
    ],
)
def test_status_and_code(err: GatewayError, status: int, code: str) -> None:
    assert http_status(err) == status
    api = from_domain(err)
    assert api.status == status
    assert api.body()["error"]["code"] == code
    assert api.body()["error"]["message"] == err.message


def test_retry_after_and_param_survive_the_mapping() -> None:
    api = from_domain(InvalidRequest("max_tokens must be positive", param="max_tokens"))
    assert api.param == "max_tokens"
    resp = from_domain(Overloaded("full", retry_after=2.4)).response()
    assert resp.headers["retry-after"] == "2"


def test_vocabulary_keeps_string_values() -> None:
    assert Role("prefill") is Role.PREFILL
    assert str(Role.PREFILL) == "prefill"
    assert f"{Mode.FALLBACK}" == "fallback"
    assert not FailureKind.INVALID.retryable
    assert FailureKind.TIMEOUT.retryable
