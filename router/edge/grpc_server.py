"""The client-facing gRPC server: ``pdserve.v1.Inference``, health, reflection, auth, TLS.

Requests are registered as raw bytes and parsed here, so that a malformed protobuf is an
INVALID_ARGUMENT naming the message rather than the library's generic INTERNAL error.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import NoReturn

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.proto import inference_pb2
from pdserve.proto.parsing import parse_request
from pdserve.router.config import RouterConfig
from pdserve.router.edge.convert import fill_chunk
from pdserve.router.edge.errors import InvalidRequestError, classify, grpc_trailing_metadata
from pdserve.router.edge.frontend import Frontend
from pdserve.router.edge.grpc_auth import ApiKeyInterceptor
from pdserve.router.edge.params_cache import ParamsCache
from pdserve.router.request.types import ChunkEvent, GenerateInput, Summary

log = logging.getLogger(__name__)

SERVICE = "pdserve.v1.Inference"
# A client deadline above this is refused: gRPC timeouts past ~1e9 s overflow (worker calls
# then fail at once), and no generation request needs more than a day.
MAX_DEADLINE_S = 24 * 3600.0
GenerateTextResponse = inference_pb2.GenerateTextResponse


class InferenceService:
    """Handlers of the three Inference methods; every error goes through
    ``pdserve.router.edge.errors``."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self._params = ParamsCache()

    async def generate(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateTextResponse]:
        # One generator from the client's request to the lifecycle's events: every layer
        # of async generator costs each chunk a resume, and this runs per chunk.
        held: ChunkEvent | None = None  # the final chunk waits for the usage figures
        try:
            inp = self._input(parse_request(inference_pb2.GenerateTextRequest, raw))
            request_id = inp.request_id
            async for event in self.frontend.generate(inp):
                if isinstance(event, Summary):
                    yield _final_response(request_id, held, event)
                elif event.is_last:
                    held = event
                else:
                    response = GenerateTextResponse(request_id=request_id)
                    fill_chunk(response.chunk, event)  # no TokenChunk built to be copied
                    yield response
        except Exception as err:
            await _abort(context, err)

    def _input(self, request: inference_pb2.GenerateTextRequest) -> GenerateInput:
        frontend = self.frontend
        model = frontend.resolve_model(request.model)
        prompt = frontend.check_prompt(self._prompt_ids(request), param=_prompt_field(request))
        default_max_tokens = frontend.max_tokens_for(None, len(prompt))
        params = self._params.from_wire(request.params, default_max_tokens)
        frontend.max_tokens_for(params.max_tokens, len(prompt))
        return frontend.build(
            model, prompt, params, request.routing_policy, deadline_s=_deadline_s(request)
        )

    def _prompt_ids(self, request: inference_pb2.GenerateTextRequest) -> Sequence[int]:
        which = request.WhichOneof("prompt")
        if which == "text":
            return self.frontend.encode_text(request.text)
        if which == "chat":
            return self.frontend.encode_chat(_messages(request.chat), param="chat")
        if which == "token_ids":
            return tuple(request.token_ids.ids)  # check_prompt keeps a tuple as it is
        raise ValueError("prompt is missing: set one of text, chat or token_ids")

    async def tokenize(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        try:
            request = parse_request(inference_pb2.TokenizeRequest, raw)
            self.frontend.resolve_model(request.model)
            which = request.WhichOneof("input")
            if which == "text":
                ids = self.frontend.encode_text(request.text)
            elif which == "chat":
                ids = self.frontend.encode_chat(_messages(request.chat), param="chat")
            else:
                raise ValueError("input is missing: set text or chat")
        except Exception as err:
            await _abort(context, err)
        return inference_pb2.TokenizeResponse(
            token_ids=ids, max_context_tokens=self.frontend.max_context_tokens
        )

    async def list_models(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        try:
            parse_request(inference_pb2.ListModelsRequest, raw)
        except Exception as err:
            await _abort(context, err)
        ctx = self.frontend.max_context_tokens
        ids = self.frontend.model_ids
        models = [inference_pb2.ModelInfo(id=m, max_context_tokens=ctx) for m in ids]
        return inference_pb2.ListModelsResponse(models=models)

    def handler(self) -> grpc.GenericRpcHandler:
        serialize = _serialize
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.generate, response_serializer=serialize
                ),
                "Tokenize": grpc.unary_unary_rpc_method_handler(
                    self.tokenize, response_serializer=serialize
                ),
                "ListModels": grpc.unary_unary_rpc_method_handler(
                    self.list_models, response_serializer=serialize
                ),
            },
        )


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _deadline_s(request: inference_pb2.GenerateTextRequest) -> float:
    deadline_s = request.deadline_s
    if not 0.0 <= deadline_s <= MAX_DEADLINE_S:  # also refuses NaN
        raise InvalidRequestError(
            f"deadline_s must be in [0, {MAX_DEADLINE_S:g}] seconds (0 = none), got {deadline_s}",
            param="deadline_s",
        )
    return deadline_s


def _prompt_field(request: inference_pb2.GenerateTextRequest) -> str:
    return request.WhichOneof("prompt") or "prompt"


def _messages(chat: inference_pb2.ChatMessages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def _final_response(
    request_id: str, held: ChunkEvent | None, summary: Summary
) -> inference_pb2.GenerateTextResponse:
    usage, timing = summary.usage, summary.timing
    response = inference_pb2.GenerateTextResponse(
        request_id=request_id,
        usage=inference_pb2.Usage(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_prompt_tokens=usage.cached_prompt_tokens,
        ),
        timing=inference_pb2.Timing(
            ttft_s=timing.ttft_s,
            e2e_s=timing.e2e_s,
            queue_s=timing.queue_s,
            transfer_s=timing.transfer_s,
        ),
        prefill_worker=summary.prefill_worker,
        decode_worker=summary.decode_worker,
    )
    if held is not None:
        fill_chunk(response.chunk, held)
    return response


async def _abort(context: grpc.aio.ServicerContext, err: Exception) -> NoReturn:
    info = classify(err)
    if info.grpc_code is grpc.StatusCode.INTERNAL:
        log.error("internal error in a gRPC request", exc_info=err)
    for key, value in grpc_trailing_metadata(info):
        context.set_trailing_metadata(((key, value),))
    await context.abort(info.grpc_code, info.message)
    raise AssertionError("context.abort() returned")  # it always raises


async def start_grpc_server(
    frontend: Frontend, config: RouterConfig, port: int | None = None
) -> tuple[grpc.aio.Server, int]:
    """A started server with Inference, health and reflection; returns it and its port.

    ``port`` overrides ``config.grpc_port`` (0 picks a free one). Stop it with
    ``await server.stop(grace_s)``.
    """
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 1 if config.reuse_port else 0),
    ]
    interceptors = [ApiKeyInterceptor(config.api_keys)] if config.api_keys else []
    server = grpc.aio.server(options=options, interceptors=interceptors)
    server.add_generic_rpc_handlers((InferenceService(frontend).handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(services, server)
    address = f"{config.host}:{config.grpc_port if port is None else port}"
    bound = _bind(server, address, config)
    await server.start()
    for service in ("", SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


def _bind(server: grpc.aio.Server, address: str, config: RouterConfig) -> int:
    if config.tls_cert_path is None or config.tls_key_path is None:
        return server.add_insecure_port(address)
    key = Path(config.tls_key_path).read_bytes()
    cert = Path(config.tls_cert_path).read_bytes()
    credentials = grpc.ssl_server_credentials([(key, cert)])
    return server.add_secure_port(address, credentials)
