"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health.

Streaming answers are Server-Sent Events (``data: {...}`` lines, then ``data: [DONE]``).
A request's first event is awaited before the response starts, so validation, overload
and routing errors still get their proper status code; an error after that arrives as a
``data: {"error": ...}`` event. Errors use OpenAI's JSON shape (see ``pdserve.router.edge.errors``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.router.config import RouterConfig
from pdserve.router.edge.errors import (
    InvalidRequestError,
    UnauthenticatedError,
    classify,
    openai_error_body,
)
from pdserve.router.edge.frontend import Frontend
from pdserve.router.edge.grpc_auth import bearer_key, key_is_valid
from pdserve.router.edge.http_collect import ClientDisconnectedError, collect_until_disconnect
from pdserve.router.edge.http_errors import (
    ERROR_RESPONSES,
    install_error_handlers,
    install_openapi,
    sse_response,
)
from pdserve.router.edge.http_schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChunk,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChunk,
    HealthResponse,
    ModelCard,
    ModelList,
    RoutingPolicyName,
    SamplingFields,
)
from pdserve.router.edge.openai_format import ChatFormatter, CompletionFormatter
from pdserve.router.request.types import ChunkEvent, GenerateInput, Summary

PolicyHeader = Annotated[
    RoutingPolicyName | None,
    Header(alias="x-pdserve-routing-policy", description="Routing policy for this request."),
]
Events = AsyncGenerator[ChunkEvent | Summary, None]
Formatter = CompletionFormatter | ChatFormatter


def create_app(frontend: Frontend, config: RouterConfig) -> FastAPI:
    """The ASGI app; serve it with uvicorn (``cluster/`` does, on ``config.http_port``)."""
    app = FastAPI(title="pdserve", version="0.1.0", description=__doc__)
    api = APIRouter(responses=ERROR_RESPONSES)
    if config.api_keys:
        api.dependencies.append(Depends(_api_key_check(config.api_keys)))

    completion_sse = sse_response(CompletionStreamChunk)
    chat_sse = sse_response(ChatStreamChunk)

    @api.post("/v1/completions", response_model=CompletionResponse, responses=completion_sse)
    async def completions(
        body: CompletionRequest, request: Request, x_policy: PolicyHeader = None
    ) -> Any:
        prompt = _completion_prompt(frontend, body)
        inp = _input(frontend, body, prompt, body.logprobs, body.max_tokens, x_policy)
        formatter = CompletionFormatter(
            f"cmpl-{inp.request_id}",
            inp.model,
            int(time.time()),
            inp.params.n,
            frontend.decode_token,
            body.logprobs is not None,
        )
        return await _respond(frontend, inp, formatter, body, request)

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=chat_sse)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, x_policy: PolicyHeader = None
    ) -> Any:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = frontend.encode_chat(messages)
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        if body.max_tokens is not None:  # checked even when max_completion_tokens wins
            frontend.check_max_tokens_limit(body.max_tokens)
        sent_as = "max_completion_tokens" if body.max_completion_tokens is not None else None
        with _field_renamed("max_tokens", sent_as):
            inp = _input(frontend, body, prompt, top, max_tokens, x_policy, param="messages")
        formatter = ChatFormatter(
            f"chatcmpl-{inp.request_id}",
            inp.model,
            int(time.time()),
            inp.params.n,
            frontend.decode_token,
            body.logprobs,
        )
        return await _respond(frontend, inp, formatter, body, request)

    _add_info_routes(app, api, frontend)
    app.include_router(api)
    install_error_handlers(app)
    # No request can ask for more than the context minus its (at least 1-token) prompt.
    max_tokens = min(config.max_tokens_limit, frontend.max_context_tokens - 1)
    install_openapi(app, frontend.model_ids, max_tokens, frontend.vocab_size)
    return app


def _add_info_routes(app: FastAPI, api: APIRouter, frontend: Frontend) -> None:
    created = int(time.time())

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        ctx = frontend.max_context_tokens
        cards = [ModelCard(id=m, created=created, max_model_len=ctx) for m in frontend.model_ids]
        return ModelList(data=cards)

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health() -> Any:
        """Unauthenticated, for probes: 503 while no worker is live."""
        workers = len(frontend.lifecycle.directory.live_workers())
        if workers == 0:
            return JSONResponse(HealthResponse(status="no_workers", workers=0).model_dump(), 503)
        return HealthResponse(status="ok", workers=workers)


def _api_key_check(keys: tuple[str, ...]) -> Any:
    async def check(authorization: Annotated[str | None, Header()] = None) -> None:
        if not key_is_valid(bearer_key(authorization), keys):
            raise UnauthenticatedError(
                "missing or invalid API key: send header 'Authorization: Bearer <key>'"
            )

    return check


def _completion_prompt(frontend: Frontend, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of exactly one prompt (the schema allows no more)
    if isinstance(prompt, str):
        return frontend.encode_text(prompt)
    return list(prompt)  # type: ignore[arg-type]


def _input(
    frontend: Frontend,
    body: SamplingFields,
    prompt: list[int],
    logprobs: int | None,
    max_tokens: int | None,
    header_policy: str | None,
    param: str = "prompt",
) -> GenerateInput:
    arrival_s = time.monotonic()
    model = _served_model(frontend, body.model)
    prompt_ids = frontend.check_prompt(prompt, param=param)
    params = frontend.sampling_params(_sampling_fields(body, logprobs), max_tokens, len(prompt_ids))
    policy = body.routing_policy or header_policy or ""
    return frontend.build(model, prompt_ids, params, policy, arrival_s=arrival_s)


@contextmanager
def _field_renamed(checked_as: str, sent_as: str | None) -> Iterator[None]:
    """An error about field ``checked_as`` names ``sent_as``, the field the client sent."""
    try:
        yield
    except InvalidRequestError as err:
        if sent_as is None or err.param != checked_as:
            raise
        message = str(err).replace(checked_as, sent_as, 1)
        raise InvalidRequestError(message, param=sent_as, code=err.code) from err


def _served_model(frontend: Frontend, model: str) -> str:
    # gRPC reads "" as proto3's "unset" and serves the default model; the OpenAI API (and
    # our published schema: an enum of the served ids) requires a model id.
    if not model:
        raise InvalidRequestError(
            f"model '' is not served here; name one of {list(frontend.model_ids)}",
            param="model",
            code="model_not_found",
        )
    return frontend.resolve_model(model)


def _sampling_fields(body: SamplingFields, logprobs: int | None) -> dict[str, Any]:
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    fields: dict[str, Any] = {
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "stop_token_ids": tuple(body.stop_token_ids),
        "stop": tuple(stop),
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
        "n": body.n,
        "speculative": body.speculative,
    }
    if body.temperature is not None:
        fields["temperature"] = body.temperature
    if body.top_p is not None:
        fields["top_p"] = body.top_p
    return fields


async def _respond(
    frontend: Frontend,
    inp: GenerateInput,
    formatter: Formatter,
    body: SamplingFields,
    request: Request,
) -> Any:
    events = frontend.generate(inp)
    if not body.stream:
        return await _whole(events, formatter, request)
    first = await _first_event(events)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    stream = _sse(first, events, formatter, include_usage)
    return StreamingResponse(stream, media_type="text/event-stream")


async def _first_event(events: Events) -> ChunkEvent | Summary:
    try:
        return await anext(events)
    except BaseException:
        await events.aclose()
        raise


async def _whole(events: Events, formatter: Formatter, request: Request) -> Any:
    try:
        collected = await collect_until_disconnect(events, request)
    except ClientDisconnectedError:
        return JSONResponse({}, status_code=499)  # nobody reads it: the client is gone
    for chunk in collected.chunks:
        formatter.add(chunk)
    return formatter.response(collected.summary)


async def _sse(
    first: ChunkEvent | Summary, events: Events, formatter: Formatter, include_usage: bool
) -> AsyncIterator[str]:
    event: ChunkEvent | Summary | None = first
    try:
        while event is not None:
            if isinstance(event, Summary):
                if include_usage:
                    yield _data(formatter.usage_chunk(event))
            else:
                yield _data(formatter.stream_chunk(event))
            event = await anext(events, None)
    except Exception as err:
        yield _data(openai_error_body(classify(err)))
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()
    yield "data: [DONE]\n\n"


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
