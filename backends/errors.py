"""Node failures and the gRPC status each maps to.

``stage`` says where a request failed (``queue``, ``pool``, ``prefill``, ``transfer``,
``decode``, ``request``) and travels as trailing metadata ``x-prefixgate-stage`` so the gateway
can tell a full prefill queue from a decode node refusing KV pages.
"""

from __future__ import annotations

import grpc


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
