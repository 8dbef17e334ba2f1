"""A steady load on the router's gRPC API that keeps every request's tokens.

Requests are sent at evenly spaced times (``rate`` per second), each one item of a fixed,
seeded dataset (``pdserve bench``'s sharegpt-like lengths, prompts as token ids), cycling
through it; even items decode greedily, odd ones sample at temperature 0.8 with the item's
own seed, so every request has one right answer to compare with. A client whose router
went away (``UNAVAILABLE`` before a token, or a stream cut) sends the whole request again,
as a client behind a load balancer would, up to ``MAX_ATTEMPTS`` times; a request that
fails otherwise is recorded with its gRPC status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import grpc

from pdserve.bench.chaos.analysis import Outcome
from pdserve.bench.serve.datasets import BenchRequest, ShareGPTLikeSpec, build_dataset
from pdserve.bench.serve.text import TextSource, load_corpus_paragraphs
from pdserve.bench.serve.tokens import load_tokenizer
from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc

MAX_ATTEMPTS = 3
REQUEST_TIMEOUT_S = 120.0
# Short chat: the cluster on two cores serves about one such request a second.
DATASET = ShareGPTLikeSpec(
    prompt_median_tokens=96.0,
    output_median_tokens=24.0,
    max_prompt_tokens=512,
    max_output_tokens=48,
    max_total_tokens=560,
)


def chaos_dataset(num_items: int, seed: int = 0) -> list[BenchRequest]:
    source = TextSource(load_tokenizer("default"), load_corpus_paragraphs())
    return [
        r for r in build_dataset(DATASET, num_items, seed, source) if isinstance(r, BenchRequest)
    ]


def request_message(key: int, request: BenchRequest) -> inference_pb2.GenerateTextRequest:
    greedy = key % 2 == 0
    params = common_pb2.SamplingParams(
        max_tokens=request.max_output_tokens,
        temperature=0.0 if greedy else 0.8,
        ignore_eos=True,
    )
    if not greedy:
        params.seed = key
    assert request.prompt.token_ids is not None, "the dataset is made with a tokenizer"
    return inference_pb2.GenerateTextRequest(
        token_ids=inference_pb2.TokenIds(ids=list(request.prompt.token_ids)), params=params
    )


class SteadyLoad:
    """Sends ``requests`` round and round at ``rate`` per second to ``target`` until stopped."""

    def __init__(
        self,
        target: str,
        requests: Sequence[BenchRequest],
        rate: float,
        outcomes: list[Outcome] | None = None,
    ) -> None:
        self._target = target
        self._requests = requests
        self._messages = [request_message(k, r) for k, r in enumerate(requests)]
        self.rate = rate
        self._interval_s = 1.0 / rate
        self.outcomes: list[Outcome] = [] if outcomes is None else outcomes
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        """Send until :meth:`stop`, then wait for the requests still running."""
        channel = grpc.aio.insecure_channel(self._target)
        stub = inference_pb2_grpc.InferenceStub(channel)
        start = time.monotonic()
        n = 0
        try:
            while not self._stopping.is_set():
                key = n % len(self._messages)
                task = asyncio.create_task(self._one(stub, key))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                n += 1
                delay = start + n * self._interval_s - time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), max(0.0, delay))
            if self._tasks:
                await asyncio.gather(*self._tasks)
        finally:
            await channel.close()

    def stop(self) -> None:
        self._stopping.set()

    def burst(self, rate: float) -> SteadyLoad:
        """Another load of the same requests at ``rate`` per second, recording into the
        same outcomes."""
        return SteadyLoad(self._target, self._requests, rate, self.outcomes)

    async def drain(self) -> None:
        """Stop sending and wait until every request sent is done."""
        self.stop()
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    async def _one(self, stub: inference_pb2_grpc.InferenceStub, key: int) -> None:
        sent = time.monotonic()
        status, first, tokens = "ok", None, list[int]()
        attempt = 0
        while attempt < MAX_ATTEMPTS:
            attempt += 1
            status, first, tokens = await self._attempt(stub, key)
            if status != "UNAVAILABLE":
                break
            await asyncio.sleep(0.2)
        self.outcomes.append(
            Outcome(key, sent, first, time.monotonic(), tuple(tokens), status, attempt)
        )

    async def _attempt(
        self, stub: inference_pb2_grpc.InferenceStub, key: int
    ) -> tuple[str, float | None, list[int]]:
        first: float | None = None
        tokens: list[int] = []
        try:
            call = stub.Generate(self._messages[key], timeout=REQUEST_TIMEOUT_S)
            async for response in call:
                if response.chunk.token_ids:
                    first = time.monotonic() if first is None else first
                    tokens += response.chunk.token_ids
        except grpc.aio.AioRpcError as err:
            return err.code().name, first, tokens
        return "ok", first, tokens
