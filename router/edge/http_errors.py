"""HTTP error handling: every error leaves in OpenAI's shape, via ``pdserve.router.edge.errors``.

Also fixes up the OpenAPI schema: FastAPI documents request validation failures as 422,
but this API (like OpenAI's) answers them with 400 in the common error shape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router.edge.errors import (
    ErrorInfo,
    InvalidRequestError,
    RouterError,
    classify,
    http_headers,
    http_status_error,
    openai_error_body,
)
from pdserve.router.edge.http_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorResponse,
    StreamOptions,
    TextPart,
)

log = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (the field is named)."},
    401: {"model": ErrorResponse, "description": "Missing or invalid API key."},
    429: {"model": ErrorResponse, "description": "Overloaded: retry after Retry-After s."},
    500: {"model": ErrorResponse, "description": "Internal error."},
    503: {"model": ErrorResponse, "description": "No worker available, or workers failed."},
    504: {"model": ErrorResponse, "description": "The request's deadline passed."},
}


_SSE_MODELS: dict[str, type[BaseModel]] = {}


def sse_response(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 ``text/event-stream`` entry, one schema per event (OpenAPI 3.1 / 3.2 style).

    Each event's ``data`` is JSON text: a chunk, an error, or the final ``[DONE]``.
    """
    _SSE_MODELS[chunk.__name__] = chunk
    data = {
        "anyOf": [
            {"$ref": f"#/components/schemas/{chunk.__name__}"},
            {"$ref": "#/components/schemas/ErrorResponse"},
        ]
    }
    json_event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": data,
            },
        },
    }
    done_event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "enum": ["[DONE]"]}},
    }
    event = {"anyOf": [done_event, json_event]}
    return {200: {"content": {"text/event-stream": {"schema": event}}}}


def error_response(info: ErrorInfo) -> JSONResponse:
    return JSONResponse(
        openai_error_body(info), status_code=info.http_status, headers=http_headers(info)
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    # Expected errors are handled at the inner layer; the Exception handler (500s) runs in
    # Starlette's outermost middleware, which also logs the traceback.
    for expected in (RouterError, ValueError, TimeoutError):
        app.add_exception_handler(expected, _any_error)
    app.add_exception_handler(Exception, _any_error)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError), f"unexpected {type(exc).__name__}"
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        message = f"request body is not valid JSON: {first.get('msg', '')}"
        param = None
    else:
        param = _field_path(first.get("loc", ()))
        got = first.get("input")
        shown = repr(got)[:80] if got is not None else "nothing"
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')} (got {shown})"
    return error_response(classify(InvalidRequestError(message, param=param)))


def _field_path(loc: Sequence[Any]) -> str | None:
    """ "messages.0.role" from a pydantic location, without union-member tags like "str"."""
    parts: list[str] = []
    for i, part in enumerate(loc):
        if i == 0 and part in ("body", "header", "query"):
            continue
        if isinstance(part, int) or part in _FIELD_NAMES or (i == 1 and loc[0] == "header"):
            parts.append(str(part))
        else:
            break
    return ".".join(parts) or None


_FIELD_NAMES = frozenset(
    name
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
    for name in model.model_fields
)


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException), f"unexpected {type(exc).__name__}"
    response = error_response(http_status_error(exc.status_code, str(exc.detail)))
    response.headers.update(exc.headers or {})  # e.g. Allow on 405
    return response


async def _any_error(request: Request, exc: Exception) -> JSONResponse:
    info = classify(exc)
    if info.http_status >= 500:
        log.error("HTTP %s %s failed: %s", request.method, request.url.path, info.message)
    return error_response(info)


def install_openapi(
    app: FastAPI, model_ids: Sequence[str], max_tokens_limit: int, vocab_size: int | None
) -> None:
    """Make the generated OpenAPI schema say what the server really accepts and answers.

    - request validation fails with 400 (not FastAPI's 422) in the common error shape;
    - ``model`` is one of the served model ids; ``max_tokens`` is at most the limit;
      prompt token ids are below the vocabulary size;
    - a header is never JSON null (FastAPI writes ``anyOf [..., null]`` for optional ones).
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
                    _non_null_headers(operation.get("parameters", []))
            components = schema.get("components", {}).get("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            _add_models(components, _SSE_MODELS.values())
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                _limit_fields(components.get(name, {}), model_ids, max_tokens_limit)
            prompt = components.get("CompletionRequest", {}).get("properties", {}).get("prompt")
            if vocab_size is not None and prompt is not None:
                _limit_integers(prompt, vocab_size - 1)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _non_null_headers(parameters: list[dict[str, Any]]) -> None:
    for parameter in parameters:
        schema = parameter.get("schema", {})
        if parameter.get("in") == "header" and "anyOf" in schema:
            kept = [s for s in schema["anyOf"] if s.get("type") != "null"]
            if len(kept) == 1:
                schema.pop("anyOf")
                schema.update(kept[0])


def _limit_fields(body: dict[str, Any], model_ids: Sequence[str], max_tokens: int) -> None:
    properties = body.get("properties", {})
    if "model" in properties:
        properties["model"]["enum"] = list(model_ids)
    for name in ("max_tokens", "max_completion_tokens"):
        for option in properties.get(name, {}).get("anyOf", []):
            if option.get("type") == "integer":
                option["maximum"] = max_tokens


def _limit_integers(schema: Any, maximum: int) -> None:
    """Set ``maximum`` on every integer schema nested in ``schema``."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = maximum
        for value in schema.values():
            _limit_integers(value, maximum)
    elif isinstance(schema, list):
        for value in schema:
            _limit_integers(value, maximum)


def _add_models(components: dict[str, Any], models: Iterable[type[BaseModel]]) -> None:
    """Put the JSON Schemas of ``models`` (and what they use) into the components."""
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in schema.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components.setdefault(model.__name__, schema)
