"""Errors the worker handlers raise, by what the caller can do about them, and the one
place that maps them to gRPC status codes (the router acts on the code).

Bad caller input is a plain ``ValueError`` (INVALID_ARGUMENT).
"""

from __future__ import annotations

import grpc


class WorkerError(Exception):
    """Base of the worker's own failures (not bad input)."""


class PreconditionFailed(WorkerError):
    """The call does not fit this worker's state or role (FAILED_PRECONDITION): e.g. a
    Decode without a live reservation, or a Prefill for another KV backend."""


class RequestCancelled(WorkerError):
    """The request was cancelled (a Cancel RPC) while the call was waiting (CANCELLED)."""


class TransferFailed(WorkerError):
    """The KV transfer ended FAILED (ABORTED): the prompt must be sent again or recomputed."""


class TransferTimedOut(WorkerError):
    """The KV transfer did not finish in the time the caller allowed (UNAVAILABLE)."""


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
