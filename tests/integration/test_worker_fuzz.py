"""Hostile input at the worker gRPC API: malformed, truncated, oversized, replayed and
out-of-order calls to a real prefill and decode worker pair (NIXL between them).

Each must be refused with a clear status, leave no block held, touch no pool block, and the
workers must serve on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.prefill_worker.prefill import PrefillService
from pdserve.proto import worker_pb2
from pdserve.worker.host import WorkerSpec
from tests.integration.worker_hosts import InProcessWorker, hosted_workers
from tests.integration.worker_procs import greedy, wait_for

pytestmark = pytest.mark.slow

NUM_BLOCKS = 32
FREED_WITHIN_S = 30.0
_COMMON = ("--num-blocks", str(NUM_BLOCKS), "--metrics-port", "-1", "--transfer-timeout-s", "10")


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[InProcessWorker, InProcessWorker]]:
    specs = [
        WorkerSpec("prefill", "fuzz-prefill", extra_args=_COMMON),
        WorkerSpec("decode", "fuzz-decode", extra_args=_COMMON),
    ]
    with hosted_workers(specs) as (prefill, decode):
        yield prefill, decode


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer: Any) -> list[int]:
    ids: list[int] = smollm2_tokenizer.encode(
        "The tide tables of a small harbour, read aloud. " * 3
    )
    assert len(ids) > 32, "the prompt must span several blocks"
    return ids


def _all_free(worker: InProcessWorker) -> bool:
    stats = worker.stats()
    return stats.free_blocks == stats.total_blocks == NUM_BLOCKS and stats.running == 0


def _reserve(decode: InProcessWorker, request_id: str, prompt: list[int]) -> Any:
    request = worker_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt)
    reply = decode.stub.ReserveKV(request, timeout=30)
    assert reply.accepted
    return reply.destination


# --- out of order: the caller leaves before the worker resumes ----------------------------


async def _first_event_then_gone(
    prefill: PrefillService, request: worker_pb2.PrefillRequest
) -> worker_pb2.PrefillEvent:
    """Take the first event and close the stream at once, as gRPC does when the caller
    cancels before the handler resumes after its first message."""
    stream = prefill.prefill(request)
    first = await anext(stream)
    await stream.aclose()
    await asyncio.sleep(0)
    return first


def test_prefill_caller_gone_before_the_stream_resumes_still_delivers(
    pair: tuple[InProcessWorker, InProcessWorker], prompt: list[int]
) -> None:
    """Regression: the transfer started only when the stream resumed after its first event,
    so a caller leaving in between left the decode worker waiting for KV that never came."""
    prefill, decode = pair
    destination = _reserve(decode, "gone-at-once", prompt)
    request = worker_pb2.PrefillRequest(
        request_id="gone-at-once",
        prompt_token_ids=prompt,
        params=greedy(8),
        destination=destination,
    )
    service = prefill.roles.prefill
    assert service is not None
    first = prefill.run(_first_event_then_gone(service, request)).first_token
    decode_request = worker_pb2.DecodeRequest(
        request_id="gone-at-once",
        prompt_token_ids=prompt,
        params=greedy(8),
        first_token=first,
        transfer_timeout_s=30.0,
    )
    chunks = list(decode.stub.Decode(decode_request, timeout=60))
    assert sum(len(c.token_ids) for c in chunks) == 7 and chunks[-1].finish_reason == "length"
    assert wait_for(lambda: _all_free(prefill), FREED_WITHIN_S)
    assert wait_for(lambda: _all_free(decode), FREED_WITHIN_S)
