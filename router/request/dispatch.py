"""One attempt at serving a request on the workers of one routing decision.

Colocated: ``Generate`` on one worker. Disaggregated::

    router --ReserveKV--> decode      refused: back-pressure, the caller tries the next pair
    router --Prefill----> prefill     first event: the first token (TTFT), streamed at once
                          (with the decision's peer fetch: prefill --FetchKV--> holder first)
                          prefill --KV blocks--> decode
    router --Decode-----> decode      the remaining tokens, already detokenized
    prefill --TransferReport--> router (last Prefill event: bytes and seconds)

A worker failing before the first token raises ``RetryableWorkerError`` (the caller tries
another worker). After it, the client has already seen output: a broken stream (an error
status, or an end before every sequence finished) raises ``StreamBrokenError``, which the
caller may fail over (router/request/failover.py); bad input and deadlines raise their own errors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from pdserve.proto import common_pb2, worker_pb2
from pdserve.router.edge.convert import chunk_from_proto
from pdserve.router.edge.errors import DeadlineExceededError, InvalidRequestError, WorkerFailedError
from pdserve.router.policies import RouteDecision
from pdserve.router.request.failover import STREAM_ENDED, StreamBreak
from pdserve.router.request.types import ChunkEvent, GenerateInput
from pdserve.router.request.worker_calls import WorkerCalls

_RETRY_ELSEWHERE = (grpc.StatusCode.RESOURCE_EXHAUSTED,)
# How long a finished decode stream waits for the prefill worker's transfer report (its
# figures go into the request's timing); it is normally there before the decode ends.
REPORT_GRACE_S = 0.5


class RetryableWorkerError(Exception):
    """``worker_id`` failed before the first token; another worker may succeed."""

    def __init__(self, worker_id: str, message: str) -> None:
        super().__init__(message)
        self.worker_id = worker_id


class StreamBrokenError(WorkerFailedError):
    """A worker stream broke after the first token; ``brk`` says which worker and how."""

    def __init__(self, brk: StreamBreak) -> None:
        super().__init__(f"{brk.describe()} failed after the first token")
        self.brk = brk


class Attempt:
    """Runs one decision; ``run()`` yields chunks and ``abort()`` frees what it holds."""

    def __init__(
        self,
        calls: WorkerCalls,
        inp: GenerateInput,
        decision: RouteDecision,
        request_id: str,
        deadline_at: float | None,
    ) -> None:
        self.calls = calls
        self.inp = inp
        self.decision = decision
        self.request_id = request_id
        self.deadline_at = deadline_at
        self.params_msg = calls.params_message(inp.params)
        self.started = False  # the first token went out
        self.refused = False  # the decode worker had no room
        self.finished = False
        self.dispatched_s: float | None = None
        self.transfer_s = 0.0
        self._unfinished = set(range(inp.params.n))  # sequence indices without a finish
        self._streams: list[grpc.aio.UnaryStreamCall] = []
        self._holding: list[str] = []  # workers that may hold state for this request

    def run(self) -> AsyncGenerator[ChunkEvent, None]:
        if self.decision.decode_worker_id is None:
            return self._colocated(self.decision.prefill_worker_id)
        return self._disaggregated(self.decision.prefill_worker_id, self.decision.decode_worker_id)

    def abort(self) -> None:
        """Stop the worker streams and tell every worker involved to free the request."""
        if self.finished:
            return
        self.finished = True
        for stream in self._streams:
            stream.cancel()
        for worker_id in self._holding:
            self.calls.cancel_in_background(worker_id, self.request_id)

    async def _colocated(self, worker_id: str) -> AsyncGenerator[ChunkEvent, None]:
        request = worker_pb2.GenerateRequest(
            request_id=self.request_id,
            prompt_token_ids=self.inp.prompt_token_ids,
            params=self.params_msg,
        )
        self._mark_dispatched()
        stream = self.calls.stub(worker_id).Generate(request, timeout=self._remaining_s())
        self._streams.append(stream)
        self._holding.append(worker_id)
        tracker = self.calls.tracker
        tokens = self._compute_tokens()
        tracker.start_prefill(worker_id, tokens)
        try:
            # stream.read() rather than `async for`: see _read.
            while (msg := await stream.read()) is not grpc.aio.EOF:
                if not self.started:
                    tracker.end_prefill(worker_id, tokens)
                    tracker.start_decode(worker_id)
                    self.started = True
                yield self._seen(chunk_from_proto(msg))
        except grpc.aio.AioRpcError as err:
            raise self._error(worker_id, err) from err
        finally:
            if self.started:
                tracker.end_decode(worker_id)
            else:
                tracker.end_prefill(worker_id, tokens)
        self._check_ended(worker_id)
        self.finished = True

    async def _disaggregated(
        self, prefill_id: str, decode_id: str
    ) -> AsyncGenerator[ChunkEvent, None]:
        self._mark_dispatched()
        destination = await self._reserve(decode_id)
        if destination is None:
            self.refused = True
            self.finished = True
            return
        tracker = self.calls.tracker
        tracker.start_decode(decode_id)
        try:
            async for chunk in self._prefill_then_decode(prefill_id, decode_id, destination):
                yield chunk
        finally:
            tracker.end_decode(decode_id)
        self.finished = True

    async def _prefill_then_decode(
        self, prefill_id: str, decode_id: str, destination: worker_pb2.KVDestination
    ) -> AsyncGenerator[ChunkEvent, None]:
        prefill = self._start_prefill(prefill_id, destination)
        first = await self._first_token(prefill, prefill_id)
        self.started = True
        yield self._seen(chunk_from_proto(first))
        if first.finish_reason:
            # Finished at the first token: the reserved KV on the decode worker is not needed.
            prefill.cancel()
            self.calls.cancel_in_background(decode_id, self.request_id)
            return
        report = asyncio.create_task(self._transfer_report(prefill, prefill_id, decode_id))
        try:
            decode = self._decode(decode_id, first)
            while (msg := await decode.read()) is not grpc.aio.EOF:  # not `async for`: _read
                yield self._seen(chunk_from_proto(msg))
            # The decode worker ran only once the KV had arrived, so the report is sent
            # or about to be; it comes on another connection and may still be on its way.
            await asyncio.wait([report], timeout=REPORT_GRACE_S)
        except grpc.aio.AioRpcError as err:
            raise self._error(decode_id, err) from err
        finally:
            if report.done() and not report.cancelled() and report.exception() is None:
                self.transfer_s = report.result()
            else:
                report.cancel()
        self._check_ended(decode_id)

    async def _reserve(self, decode_id: str) -> worker_pb2.KVDestination | None:
        request = worker_pb2.ReserveKVRequest(
            request_id=self.request_id, prompt_token_ids=self.inp.prompt_token_ids
        )
        try:
            response = await self.calls.stub(decode_id).ReserveKV(
                request, timeout=self._rpc_timeout_s()
            )
        except grpc.aio.AioRpcError as err:
            if err.code() in _RETRY_ELSEWHERE:
                return None
            raise self._error(decode_id, err) from err
        if not response.accepted:
            return None
        self._holding.append(decode_id)
        return response.destination

    def _start_prefill(
        self, prefill_id: str, destination: worker_pb2.KVDestination
    ) -> grpc.aio.UnaryStreamCall:
        request = worker_pb2.PrefillRequest(
            request_id=self.request_id,
            prompt_token_ids=self.inp.prompt_token_ids,
            params=self.params_msg,
            destination=destination,
        )
        fetch = self.decision.fetch
        if fetch is not None:  # the prefill worker pulls this prefix from its holder first
            request.peer_prefix.worker_id = fetch.holder_id
            request.peer_prefix.address = self.calls.address(fetch.holder_id)
            request.peer_prefix.num_blocks = fetch.num_blocks
        stream = self.calls.stub(prefill_id).Prefill(request, timeout=self._remaining_s())
        self._streams.append(stream)
        self._holding.append(prefill_id)
        return stream

    async def _first_token(
        self, prefill: grpc.aio.UnaryStreamCall, prefill_id: str
    ) -> common_pb2.TokenChunk:
        tokens = self._compute_tokens()
        self.calls.tracker.start_prefill(prefill_id, tokens)
        try:
            async for event in self._read(prefill, prefill_id):
                if event.HasField("first_token"):
                    return event.first_token
                if not event.transfer.ok:
                    msg = f"KV transfer failed before the first token: {event.transfer.error}"
                    raise RetryableWorkerError(prefill_id, f"prefill worker {prefill_id}: {msg}")
        finally:
            self.calls.tracker.end_prefill(prefill_id, tokens)
        raise RetryableWorkerError(
            prefill_id, f"prefill worker {prefill_id} ended its stream without a first token"
        )

    async def _transfer_report(
        self, prefill: grpc.aio.UnaryStreamCall, prefill_id: str, decode_id: str
    ) -> float:
        """Seconds the KV transfer took (0 when the worker sent no report); a transfer that
        succeeded also measures the link from ``prefill_id`` to ``decode_id``."""
        async for event in self._read(prefill, prefill_id):
            if event.HasField("transfer"):
                report = event.transfer
                if report.ok:
                    self.calls.link_rates.observe(
                        prefill_id, decode_id, report.bytes, report.seconds, time.monotonic()
                    )
                return float(report.seconds)
        return 0.0

    def _decode(self, decode_id: str, first: common_pb2.TokenChunk) -> grpc.aio.UnaryStreamCall:
        request = worker_pb2.DecodeRequest(
            request_id=self.request_id,
            prompt_token_ids=self.inp.prompt_token_ids,
            params=self.params_msg,
            first_token=first,
            transfer_timeout_s=self.calls.config.transfer_timeout_s,
        )
        stream = self.calls.stub(decode_id).Decode(request, timeout=self._remaining_s())
        self._streams.append(stream)
        return stream

    async def _read(
        self, stream: grpc.aio.UnaryStreamCall, worker_id: str
    ) -> AsyncGenerator[Any, None]:
        """The stream's messages, with gRPC errors turned into the router's own.

        The token streams (Generate, Decode) are read inline instead, with
        ``stream.read()``: ``async for`` over a call, and this generator, would each add a
        generator resume to every chunk the router relays.
        """
        try:
            async for msg in stream:
                yield msg
        except grpc.aio.AioRpcError as err:
            raise self._error(worker_id, err) from err

    def _seen(self, chunk: ChunkEvent) -> ChunkEvent:
        if chunk.finish_reason is not None:
            self._unfinished.discard(chunk.index)
        return chunk

    def _check_ended(self, worker_id: str) -> None:
        """A stream that ended cleanly must have finished every sequence it started."""
        if not self.started:
            raise RetryableWorkerError(
                worker_id, f"worker {worker_id} ended its stream without sending a token"
            )
        if self._unfinished:
            detail = f"the stream ended before sequences {sorted(self._unfinished)} finished"
            raise StreamBrokenError(StreamBreak(worker_id, STREAM_ENDED, detail))

    def _error(self, worker_id: str, err: grpc.aio.AioRpcError) -> Exception:
        code, details = err.code(), err.details()
        where = f"worker {worker_id} ({code.name}: {details})"
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidRequestError(f"the request was rejected by {where}")
        if self.deadline_at is not None and time.monotonic() >= self.deadline_at:
            return DeadlineExceededError(
                f"request {self.inp.request_id} passed its deadline at {where}"
            )
        if self.started:
            return StreamBrokenError(StreamBreak(worker_id, code.name, details or ""))
        return RetryableWorkerError(worker_id, f"{where} failed before the first token")

    def _compute_tokens(self) -> int:
        """The prefill work this attempt queues on its worker, as the router counts it:
        what the policy predicted (its cache and a fetch cover the rest), else the prompt."""
        predicted = self.decision.compute_tokens
        return predicted if predicted is not None else len(self.inp.prompt_token_ids)

    def _mark_dispatched(self) -> None:
        if self.dispatched_s is None:
            self.dispatched_s = time.monotonic()

    def _remaining_s(self) -> float | None:
        if self.deadline_at is None:
            return None
        remaining_s = self.deadline_at - time.monotonic()
        if remaining_s <= 0:
            raise DeadlineExceededError(
                f"request {self.inp.request_id} passed its deadline before reaching a worker"
            )
        return remaining_s

    def _rpc_timeout_s(self) -> float:
        remaining_s = self._remaining_s()
        limit_s = self.calls.config.worker_rpc_timeout_s
        return limit_s if remaining_s is None else min(limit_s, remaining_s)
