"""Domain errors of the gateway core, free of any transport's status codes and web framework.

The core (pipeline, cache operations, documents, service) and the request validation it runs
(``prefixgate.openai.schema``) raise these; each front end maps them once: the HTTP front end to
an OpenAI-format error with an HTTP status (``prefixgate.openai.errors``), the gRPC front end to
a gRPC status. ``code`` is the OpenAI ``error.code`` both front ends send; ``param`` names the
offending request field where there is one. This module imports nothing, so the OpenAI
protocol layer and the nodes' own HTTP endpoint raise the same errors without importing the
rest of the gateway.
"""

from __future__ import annotations


class GatewayError(Exception):
    """A request the gateway cannot serve, and why."""

    default_code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.retry_after = retry_after


class InvalidRequest(GatewayError):
    """The request is malformed or asks for something the gateway does not do."""

    default_code = "invalid_request"


class Unprocessable(InvalidRequest):
    """Well-formed, but the engine could not follow it (a constraint whose grammar failed)."""

    default_code = "invalid_constraint"


class Unauthenticated(GatewayError):
    """No credentials, or wrong ones."""

    default_code = "invalid_api_key"


class Forbidden(GatewayError):
    """Valid credentials that do not allow this."""

    default_code = "forbidden"


class NotFound(GatewayError):
    """The named resource (node, document, model) does not exist."""

    default_code = "not_found"


class Conflict(GatewayError):
    """The resource already exists, or its state forbids the change."""

    default_code = "conflict"


class TooLarge(GatewayError):
    """Over a size bound (body, prompt, document, message count)."""

    default_code = "too_large"


class QuotaExceeded(GatewayError):
    """The tenant's quota (pins, documents) is used up."""

    default_code = "quota_exceeded"


class RateLimited(QuotaExceeded):
    """Over a tenant's or an API key's tokens or requests per minute: retry after ``retry_after``."""

    default_code = "rate_limit_exceeded"


class Overloaded(GatewayError):
    """Every node, or the gateway itself, is at capacity: retry shortly."""

    default_code = "overloaded"


class Unavailable(GatewayError):
    """No node could serve the request now."""

    default_code = "unavailable"


class Draining(Unavailable):
    """The gateway is shutting down and takes no new requests."""

    default_code = "shutting_down"


class DeadlineExceeded(GatewayError):
    """The request's deadline passed before it could be served."""

    default_code = "deadline_exceeded"


class StreamBroken(GatewayError):
    """Generation failed after the first token was sent: nothing can be retried."""

    default_code = "stream_broken"


def invalid(message: str, param: str | None = None, code: str | None = None) -> InvalidRequest:
    """A malformed request (HTTP 400, gRPC INVALID_ARGUMENT)."""
    return InvalidRequest(message, param=param, code=code)
