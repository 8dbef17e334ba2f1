"""The one mapping from internal errors to gRPC codes, HTTP statuses and OpenAI bodies."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.edge.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    NoWorkersError,
    OverloadedError,
    UnauthenticatedError,
    WorkerFailedError,
    classify,
    grpc_trailing_metadata,
    http_headers,
    openai_error_body,
)

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("err", "code", "status", "error_type"),
    [
        (ValueError("x must be > 0"), S.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (
            InvalidRequestError("bad", param="model"),
            S.INVALID_ARGUMENT,
            400,
            "invalid_request_error",
        ),
        (UnauthenticatedError("no key"), S.UNAUTHENTICATED, 401, "authentication_error"),
        (OverloadedError("busy", 2), S.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (NoWorkersError("none"), S.UNAVAILABLE, 503, "server_error"),
        (WorkerFailedError("died"), S.UNAVAILABLE, 503, "server_error"),
        (DeadlineExceededError("late"), S.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (TimeoutError(), S.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (KeyError("oops"), S.INTERNAL, 500, "server_error"),
    ],
)
def test_each_error_maps_to_its_codes(
    err: Exception, code: grpc.StatusCode, status: int, error_type: str
) -> None:
    info = classify(err)
    assert (info.grpc_code, info.http_status, info.error_type) == (code, status, error_type)
    assert info.message


def test_sampling_params_errors_name_their_field() -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(temperature=-1.0)
    info = classify(caught.value)
    assert info.param == "temperature"
    assert "temperature must be >= 0" in info.message and "-1.0" in info.message


def test_openai_body_shape_and_retry_after() -> None:
    info = classify(OverloadedError("too many requests in flight", retry_after_s=3))
    body = openai_error_body(info)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert http_headers(info) == {"Retry-After": "3"}
    assert grpc_trailing_metadata(info) == (("retry-after", "3"),)


def test_explicit_param_and_code_win() -> None:
    info = classify(InvalidRequestError("no such model", param="model", code="model_not_found"))
    assert (info.param, info.code) == ("model", "model_not_found")
    assert classify(ValueError("Something odd")).param is None
