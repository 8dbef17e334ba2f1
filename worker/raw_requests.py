"""The ``pdserve.v1.Worker`` service registered over raw request bytes.

gRPC's generated registration deserializes each request before the handler runs, and
answers bytes that are not the message with a bare "Exception deserializing request". Here
each handler receives the bytes, parses them (``pdserve.proto.parsing``) and refuses what
does not parse with INVALID_ARGUMENT naming the message type; the servicer's methods then
run exactly as the generated registration would call them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.parsing import parse_request

_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"]


def add_worker_service(server: grpc.aio.Server, servicer: worker_pb2_grpc.WorkerServicer) -> None:
    """Serve ``servicer``'s methods as ``pdserve.v1.Worker`` on ``server``."""
    handlers = {method.name: _handler(servicer, method) for method in _SERVICE.methods}
    generic = grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers)
    server.add_generic_rpc_handlers((generic,))


def _handler(servicer: Any, method: MethodDescriptor) -> grpc.RpcMethodHandler:
    request_type: type[Message] = GetMessageClass(method.input_type)
    call: Callable[..., Any] = getattr(servicer, method.name)

    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        try:
            return parse_request(request_type, raw)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise AssertionError("context.abort() returned") from err  # it always raises

    if method.server_streaming:

        async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for reply in call(await parsed(raw, context), context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(stream, response_serializer=_serialize)

    async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await call(await parsed(raw, context), context)

    return grpc.unary_unary_rpc_method_handler(unary, response_serializer=_serialize)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()
