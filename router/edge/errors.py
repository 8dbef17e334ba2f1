"""THE one place that maps internal errors to gRPC status codes and HTTP responses.

| error                              | gRPC                | HTTP | OpenAI type           |
|------------------------------------|---------------------|------|-----------------------|
| ValueError / InvalidRequestError   | INVALID_ARGUMENT    | 400  | invalid_request_error |
| UnauthenticatedError               | UNAUTHENTICATED     | 401  | authentication_error  |
| OverloadedError                    | RESOURCE_EXHAUSTED  | 429  | rate_limit_error      |
| NoWorkersError                     | UNAVAILABLE         | 503  | server_error          |
| WorkerFailedError                  | UNAVAILABLE         | 503  | server_error          |
| DeadlineExceededError, TimeoutError| DEADLINE_EXCEEDED   | 504  | timeout_error         |
| anything else                      | INTERNAL            | 500  | server_error          |
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import grpc


class RouterError(Exception):
    """Base of the router's own errors; the class decides the status codes."""


class InvalidRequestError(RouterError, ValueError):
    """Bad caller input; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class UnauthenticatedError(RouterError):
    pass


class OverloadedError(RouterError):
    """Too many requests in flight: the client should retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoWorkersError(RouterError):
    pass


class WorkerFailedError(RouterError):
    pass


class DeadlineExceededError(RouterError):
    pass


@dataclass(slots=True, frozen=True)
class ErrorInfo:
    grpc_code: grpc.StatusCode
    http_status: int
    error_type: str
    code: str | None
    message: str
    param: str | None = None
    retry_after_s: int | None = None


# (error class, grpc code, http status, OpenAI type, default code), most specific first.
_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode, int, str, str | None], ...] = (
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error",
     "invalid_api_key"),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error",
     "rate_limit_exceeded"),
    (NoWorkersError, grpc.StatusCode.UNAVAILABLE, 503, "server_error", "no_workers"),
    (WorkerFailedError, grpc.StatusCode.UNAVAILABLE, 503, "server_error", "worker_failed"),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error",
     "deadline_exceeded"),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error", "deadline_exceeded"),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", None),
)  # fmt: skip

_LEADING_FIELD = re.compile(r"^([a-z][a-z0-9_]*)(?:\[\d+\])?(?: |:)")


def classify(err: BaseException) -> ErrorInfo:
    """Status codes, OpenAI error type and field name for ``err``."""
    for cls, grpc_code, http_status, error_type, code in _TABLE:
        if isinstance(err, cls):
            message = str(err) or type(err).__name__
            return ErrorInfo(
                grpc_code,
                http_status,
                error_type,
                getattr(err, "code", None) or code,
                message,
                _param_of(err, message),
                getattr(err, "retry_after_s", None),
            )
    message = f"internal error: {type(err).__name__}: {err}"
    return ErrorInfo(grpc.StatusCode.INTERNAL, 500, "server_error", "internal_error", message)


def http_status_error(status: int, message: str) -> ErrorInfo:
    """An HTTP-level error raised by the web framework itself (unknown path, bad method)."""
    if status < 500:
        code = grpc.StatusCode.INVALID_ARGUMENT
        return ErrorInfo(code, status, "invalid_request_error", None, message)
    return ErrorInfo(grpc.StatusCode.INTERNAL, status, "server_error", None, message)


def _param_of(err: BaseException, message: str) -> str | None:
    if isinstance(err, InvalidRequestError):
        return err.param
    if not isinstance(err, ValueError):
        return None
    # Validation messages start with the field: "temperature must be >= 0, got -1.0".
    match = _LEADING_FIELD.match(message)
    return match.group(1) if match else None


def openai_error_body(info: ErrorInfo) -> dict[str, Any]:
    """OpenAI's JSON error shape."""
    return {
        "error": {
            "message": info.message,
            "type": info.error_type,
            "param": info.param,
            "code": info.code,
        }
    }


def http_headers(info: ErrorInfo) -> dict[str, str]:
    if info.retry_after_s is not None:
        return {"Retry-After": str(info.retry_after_s)}
    if info.http_status == 401:
        return {"WWW-Authenticate": "Bearer"}
    return {}


def grpc_trailing_metadata(info: ErrorInfo) -> tuple[tuple[str, str], ...]:
    if info.retry_after_s is not None:
        return (("retry-after", str(info.retry_after_s)),)
    return ()
