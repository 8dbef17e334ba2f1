"""Optional API keys on the gRPC server: metadata ``authorization: Bearer <key>``.

Health checks stay open (load balancers and Kubernetes probes carry no key). Keys are
compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc

OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


def bearer_key(header: str | None) -> str | None:
    """The key in an ``Authorization: Bearer <key>`` value, or None."""
    if not header:
        return None
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def key_is_valid(key: str | None, keys: Sequence[str]) -> bool:
    if key is None:
        return False
    candidate = key.encode()
    # Check every key (no early exit) so timing does not tell which prefix matched.
    matches = [hmac.compare_digest(candidate, k.encode()) for k in keys]
    return any(matches)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(keys)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in OPEN_METHODS:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        header = metadata.get("authorization")
        if key_is_valid(bearer_key(header if isinstance(header, str) else None), self._keys):
            return handler
        return _denying(handler)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or invalid API key: send metadata 'authorization: Bearer <key>'",
    )


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that rejects the call."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_deny, **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_deny, **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_deny, **codec)
    return grpc.stream_stream_rpc_method_handler(_deny, **codec)
