"""The gRPC client of the router's ``pdserve.v1.Inference`` service (``--backend grpc``).

Each streamed ``GenerateTextResponse`` whose chunk carries token ids is one token event (of
``len(token_ids)`` tokens); the last message's ``usage`` gives the exact counts.
"""

from __future__ import annotations

from typing import Any

import grpc

from pdserve.bench.serve.datasets import BenchRequest
from pdserve.bench.serve.outputs import (
    ChatHistory,
    RequestOptions,
    RequestOutput,
    StreamRecorder,
    prompt_tokens_estimate,
)
from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc


class GrpcClient:
    """Streams requests to the router's gRPC address ``target`` (``host:port``), plaintext."""

    def __init__(self, target: str, options: RequestOptions) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)
        self._options = options
        key = options.api_key
        self._metadata = (("authorization", f"Bearer {key}"),) if key else ()

    async def send(
        self, request: BenchRequest, history: ChatHistory | None = None
    ) -> RequestOutput:
        message = self._request(request, history)
        recorder = StreamRecorder(prompt_tokens_estimate(request, history))
        try:
            call = self._stub.Generate(
                message, metadata=self._metadata, timeout=self._options.timeout_s
            )
            async for response in call:
                _record(response, recorder)
        except grpc.aio.AioRpcError as err:
            recorder.fail(f"gRPC {err.code().name}: {err.details()}")
        return recorder.result()

    async def model_ids(self) -> list[str]:
        reply = await self._stub.ListModels(
            inference_pb2.ListModelsRequest(), metadata=self._metadata, timeout=30.0
        )
        return [m.id for m in reply.models]

    async def aclose(self) -> None:
        await self._channel.close()

    def _request(
        self, request: BenchRequest, history: ChatHistory | None
    ) -> inference_pb2.GenerateTextRequest:
        opts = self._options
        params = common_pb2.SamplingParams(
            max_tokens=request.max_output_tokens,
            temperature=opts.temperature,
            ignore_eos=opts.ignore_eos,
        )
        message = inference_pb2.GenerateTextRequest(model=opts.model, params=params)
        prompt = request.prompt
        if history is not None:
            turns = [*history, ("user", prompt.text)]
            chat = [inference_pb2.ChatMessage(role=r, content=c) for r, c in turns]
            message.chat.messages.extend(chat)
        elif prompt.token_ids:
            message.token_ids.ids.extend(prompt.token_ids)
        else:
            message.text = prompt.text
        return message


def _record(response: Any, recorder: StreamRecorder) -> None:
    ids = response.chunk.token_ids
    if ids:
        recorder.token(response.chunk.text, len(ids))
    if response.HasField("usage"):
        usage = response.usage
        recorder.usage(usage.prompt_tokens, usage.completion_tokens)
