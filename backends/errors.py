"""Node failures, the gRPC status each maps to, and how every face answers with one.

``stage`` says where a request failed (``queue``, ``pool``, ``prefill``, ``transfer``,
``decode``, ``request``) and travels as trailing metadata ``x-prefixgate-stage`` on the native
protocol (so the gateway can tell a full prefill queue from a decode node refusing KV pages) and
as the error's ``code`` on the HTTP face.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import structlog

log = structlog.get_logger("prefixgate.node")

# The HTTP face's status for each code (500 for the others), as OpenAI-compatible servers answer.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
}


class NodeError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    trailers: tuple[tuple[str, str], ...] = ()  # trailing metadata to send with the status

    def __init__(self, message: str, *, stage: str = "request", code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.stage = stage
        if code is not None:
            self.code = code


class InvalidArgument(NodeError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(NodeError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(NodeError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(NodeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(NodeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(NodeError):
    code = grpc.StatusCode.DATA_LOSS


class Unavailable(NodeError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(NodeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def http_status(e: NodeError) -> int:
    return HTTP_STATUS.get(e.code, 500)


async def abort_rpc(context: Any, e: NodeError, trailers: Sequence[tuple[str, str]] | None = None) -> None:
    """End a gRPC call with ``e``'s status (logged); ``trailers``: the face's own trailing
    metadata, ``e.trailers`` when not given. Raises, as ``ServicerContext.abort`` does."""
    log.warning("request failed", code=e.code.name, stage=e.stage, error=e.message)
    await context.abort(
        e.code, e.message, trailing_metadata=tuple(e.trailers if trailers is None else trailers)
    )
