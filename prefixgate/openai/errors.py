"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from prefixgate.gateway.core.errors import (
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
    Unprocessable,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error to answer in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        hdrs = dict(headers or {})
        if self.retry_after is not None:
            hdrs["Retry-After"] = str(max(1, round(self.retry_after)))
        return JSONResponse(self.body(), status_code=self.status, headers=hdrs)


_STATUS: tuple[tuple[type[GatewayError], int], ...] = (
    (Unprocessable, 422),
    (InvalidRequest, 400),
    (Unauthenticated, 401),
    (Forbidden, 403),
    (NotFound, 404),
    (Conflict, 409),
    (TooLarge, 413),
    (QuotaExceeded, 429),
    (Overloaded, 429),
    (Draining, 503),
    (Unavailable, 503),
    (DeadlineExceeded, 504),
    (StreamBroken, 502),
)


def http_status(e: GatewayError) -> int:
    """The HTTP status a domain error is answered with (500 for anything unmapped)."""
    for cls, status in _STATUS:
        if isinstance(e, cls):
            return status
    return 500


def from_domain(e: GatewayError) -> APIError:
    """The OpenAI-format HTTP error for a domain error: the one place the two meet."""
    return APIError(http_status(e), e.message, param=e.param, code=e.code, retry_after=e.retry_after)
