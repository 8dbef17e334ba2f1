"""The OpenAI-compatible HTTP client: streamed ``/v1/completions`` and ``/v1/chat/completions``.

Completions send token ids when the prompt has them (exact lengths; no re-tokenization on the
server), text otherwise. Usage figures are requested with ``stream_options.include_usage``.
"""

from __future__ import annotations

from typing import Any

import httpx

from pdserve.bench.serve.datasets import BenchRequest
from pdserve.bench.serve.outputs import (
    ChatHistory,
    RequestOptions,
    RequestOutput,
    StreamRecorder,
    prompt_tokens_estimate,
)
from pdserve.bench.serve.sse import DONE, SSEDecoder, parse_chunk


class OpenAIClient:
    """Streams requests to an OpenAI-compatible server at ``base_url`` (no ``/v1`` suffix)."""

    def __init__(self, base_url: str, options: RequestOptions, max_connections: int) -> None:
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            limits=limits,
            timeout=httpx.Timeout(options.timeout_s),
        )
        self._options = options

    async def send(
        self, request: BenchRequest, history: ChatHistory | None = None
    ) -> RequestOutput:
        if history is None:
            path, body = "/v1/completions", self._completion_body(request)
        else:
            path, body = "/v1/chat/completions", self._chat_body(request, history)
        recorder = StreamRecorder(prompt_tokens_estimate(request, history))
        try:
            await self._stream(path, body, recorder)
        except (httpx.HTTPError, ValueError) as err:  # ValueError: a malformed JSON chunk
            recorder.fail(f"{type(err).__name__}: {err}")
        return recorder.result()

    async def model_ids(self) -> list[str]:
        response = await self._http.get("/v1/models")
        response.raise_for_status()
        return [str(card["id"]) for card in response.json().get("data", [])]

    async def aclose(self) -> None:
        await self._http.aclose()

    def _sampling(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._options.model,
            "max_tokens": request.max_output_tokens,
            "temperature": self._options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self._options.ignore_eos:  # an extension (vLLM, pdserve); OpenAI has no such field
            body["ignore_eos"] = True
        return body

    def _completion_body(self, request: BenchRequest) -> dict[str, Any]:
        prompt = request.prompt
        ids = prompt.token_ids
        return {**self._sampling(request), "prompt": list(ids) if ids else prompt.text}

    def _chat_body(self, request: BenchRequest, history: ChatHistory) -> dict[str, Any]:
        messages = [{"role": role, "content": content} for role, content in history]
        messages.append({"role": "user", "content": request.prompt.text})
        return {**self._sampling(request), "messages": messages}

    async def _stream(self, path: str, body: dict[str, Any], recorder: StreamRecorder) -> None:
        async with self._http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                recorder.fail(f"HTTP {response.status_code}: {detail}")
                return
            decoder = SSEDecoder()
            async for line in response.aiter_lines():
                data = decoder.feed(line)
                if data is not None and _handle(data, recorder):
                    return
            data = decoder.flush()
            if data is not None:
                _handle(data, recorder)


def _handle(data: str, recorder: StreamRecorder) -> bool:
    """Apply one event to the recorder; True when the stream is over."""
    if data.strip() == DONE:
        return True
    chunk = parse_chunk(data)
    if chunk.error is not None:
        recorder.fail(f"error event: {chunk.error}")
        return True
    if chunk.is_token:
        recorder.token(chunk.text)
    recorder.usage(chunk.prompt_tokens, chunk.completion_tokens)
    return False
