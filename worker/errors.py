"""The one place that maps the worker handlers' errors to gRPC status codes (the router acts
on the code). Both worker roles raise them; they live in ``pdserve.kv_transfer.handoff`` so that
neither role imports the other, and are re-exported here.

Bad caller input is a plain ``ValueError`` (INVALID_ARGUMENT).
"""

from __future__ import annotations

import grpc

from pdserve.kv_transfer.handoff import (
    HandoffError,
    PreconditionFailed,
    RequestCancelled,
    TransferFailed,
    TransferTimedOut,
)

__all__ = [
    "HandoffError",
    "PreconditionFailed",
    "RequestCancelled",
    "TransferFailed",
    "TransferTimedOut",
    "status_for",
]


_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (PreconditionFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (RequestCancelled, grpc.StatusCode.CANCELLED),
    (TransferFailed, grpc.StatusCode.ABORTED),
    (TransferTimedOut, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (RuntimeError, grpc.StatusCode.UNAVAILABLE),  # the engine thread has stopped
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status of a handler's exception; INTERNAL for anything unexpected."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL
