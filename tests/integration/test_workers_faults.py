"""Worker failure paths over real processes, gRPC and NIXL.

"Mid-transfer" is made real with the prefill worker's injected sender pause (after the
first block): the decode worker is killed while the rest of the blocks wait to be sent.
Freed blocks are checked through GetStats: free_blocks back to the pool size; whether a
transfer is open, through its transfers_in_flight (tests wait on that state, not on sleeps).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.proto import common_pb2, worker_pb2
from tests.integration.worker_procs import (
    WorkerProc,
    greedy,
    launch_worker,
    run_disaggregated,
    run_generate,
    running,
    wait_for,
)

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64
COMMON = ("--num-blocks", str(NUM_BLOCKS), "--kv-backend", "nixl")
PAUSE_S = 4.0  # the prefill's sender waits this long after the first block of a transfer
# Bounds, not measurements: a reservation must be claimed, and a transfer (prefill, connect,
# PAUSE_S, the rest) must land, within these on a machine busy with other jobs.
TRANSFER_TIMEOUT_S = 15.0
RESERVATION_TIMEOUT_S = 10.0
FREED_WITHIN_S = 40.0  # covers the reservation + transfer timeouts, with room on a busy box


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProc]]:
    tmp: Path = tmp_path_factory.mktemp("workers_faults")
    timeouts = ("--transfer-timeout-s", str(TRANSFER_TIMEOUT_S))
    pause = ("--fault-pause-after-blocks", "1", "--fault-pause-s", str(PAUSE_S))
    launched = [
        launch_worker("prefill-slow", "prefill", tmp, *COMMON, *timeouts, *pause),
        launch_worker(
            "decode-short",
            "decode",
            tmp,
            *COMMON,
            *timeouts,
            "--reservation-timeout-s",
            str(RESERVATION_TIMEOUT_S),
        ),
        launch_worker("decode-victim", "decode", tmp, *COMMON, *timeouts),
    ]
    with running(launched) as started:
        yield {w.name: w for w in started}


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer: Any) -> list[int]:
    text = "A lighthouse keeper counts the ships that pass at night and writes each one down, "
    ids = smollm2_tokenizer.encode(text * 3)
    assert len(ids) > 32, "the prompt must span several blocks"
    return ids


def _all_free(worker: WorkerProc) -> bool:
    stats = worker.stats()
    return stats.free_blocks == stats.total_blocks == NUM_BLOCKS and stats.running == 0


def _reserve(worker: WorkerProc, request_id: str, prompt: list[int]) -> Any:
    request = worker_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt)
    reply = worker.stub.ReserveKV(request, timeout=30)
    assert reply.accepted
    return reply.destination


def _decode_request(request_id: str, prompt: list[int], first: Any, timeout_s: float) -> Any:
    return worker_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=greedy(16),
        first_token=first,
        transfer_timeout_s=timeout_s,
    )


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details() or ""


def test_decode_worker_killed_mid_transfer(
    workers: dict[str, WorkerProc], prompt: list[int]
) -> None:
    prefill, victim = workers["prefill-slow"], workers["decode-victim"]
    destination = _reserve(victim, "victim-1", prompt)
    prefill_request = worker_pb2.PrefillRequest(
        request_id="victim-1", prompt_token_ids=prompt, params=greedy(16), destination=destination
    )
    events = prefill.stub.Prefill(prefill_request, timeout=120)
    first = next(events).first_token
    assert len(first.token_ids) == 1 and not first.finish_reason
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        decode_request = _decode_request("victim-1", prompt, first, 60.0)
        decoding = pool.submit(lambda: list(victim.stub.Decode(decode_request, timeout=120)))
        # Sequencing by state, not by sleeping: the kill falls while the prefill reports the
        # transfer open (its sender pauses PAUSE_S after the first block).
        assert wait_for(lambda: prefill.stats().transfers_in_flight == 1, TRANSFER_TIMEOUT_S)
        assert not decoding.done(), "Decode must still be waiting for the KV"
        victim.kill()
        code, _details = _code(decoding.result)
    assert code is grpc.StatusCode.UNAVAILABLE, "the caller of the dead worker sees UNAVAILABLE"
    report = next(events).transfer
    assert not report.ok and report.blocks_sent == 0
    assert "victim-1" in report.error, report.error
    assert wait_for(lambda: _all_free(prefill), FREED_WITHIN_S), "prefill freed its blocks"
    assert prefill.stats().transfers_failed >= 1


def _held_while_in_flight(worker: WorkerProc, timeout_s: float) -> tuple[int, bool]:
    """Poll GetStats until no transfer is open; returns (snapshots taken while one was open,
    whether every one of them still showed source blocks held).

    One GetStats answer is a consistent snapshot for this purpose: the worker reads its
    transfer count before it asks the engine for free blocks, and it frees a transfer's
    source blocks only after the transfer has ended.
    """
    seen_open, held = 0, True
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        stats = worker.stats()
        if stats.transfers_in_flight == 0:
            return seen_open, held
        seen_open += 1
        held = held and stats.free_blocks < stats.total_blocks
        time.sleep(0.05)
    raise AssertionError(f"{worker.name}: a transfer was still open after {timeout_s}s")


def _prefill_until_first_token(
    prefill: WorkerProc, decode: WorkerProc, request_id: str, prompt: list[int]
) -> tuple[Any, common_pb2.TokenChunk]:
    """Reserve on ``decode``, start Prefill on an idle ``prefill``; the open stream and the
    first token (8 greedy tokens asked for)."""
    assert wait_for(lambda: _all_free(prefill), FREED_WITHIN_S)
    destination = _reserve(decode, request_id, prompt)
    request = worker_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, params=greedy(8), destination=destination
    )
    events = prefill.stub.Prefill(request, timeout=120)
    return events, next(events).first_token


def test_prefill_caller_gone_mid_transfer_still_delivers_then_frees(
    workers: dict[str, WorkerProc], prompt: list[int]
) -> None:
    prefill, decode = workers["prefill-slow"], workers["decode-short"]
    events, first = _prefill_until_first_token(prefill, decode, "gone-1", prompt)
    decode_request = _decode_request("gone-1", prompt, first, 30.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Decode claims the reservation at once (as the router does), before it can expire.
        decoding = pool.submit(lambda: list(decode.stub.Decode(decode_request, timeout=60)))
        # Sequencing by state, not by sleeping: the caller leaves only once the worker reports
        # the transfer open (its sender pauses PAUSE_S after the first block).
        assert wait_for(lambda: prefill.stats().transfers_in_flight == 1, TRANSFER_TIMEOUT_S)
        events.cancel()  # the router went away; the transfer goes on, then the KV is released
        seen_open, held = _held_while_in_flight(prefill, FREED_WITHIN_S)
        chunks = decoding.result()
    assert seen_open > 0 and held, f"KV released while still being sent ({seen_open} probes)"
    assert sum(len(c.token_ids) for c in chunks) == 15 and chunks[-1].finish_reason == "length"
    assert wait_for(lambda: _all_free(prefill), FREED_WITHIN_S)
    assert wait_for(lambda: _all_free(decode), FREED_WITHIN_S)
    assert prefill.stats().transfers_ok >= 1


def test_prefill_caller_gone_right_after_the_first_token_still_delivers(
    workers: dict[str, WorkerProc], prompt: list[int]
) -> None:
    # The caller leaves as soon as it has the first token: the worker may still be looking
    # up the blocks to send. The transfer must happen all the same (the decode worker
    # waits for it), and then every block must be freed. (The window is short: without the
    # fix this fails only when the cancel lands during the lookup.)
    prefill, decode = workers["prefill-slow"], workers["decode-short"]
    events, first = _prefill_until_first_token(prefill, decode, "gone-2", prompt)
    events.cancel()
    chunks = list(decode.stub.Decode(_decode_request("gone-2", prompt, first, 30.0), timeout=60))
    assert sum(len(c.token_ids) for c in chunks) == 15 and chunks[-1].finish_reason == "length"
    assert wait_for(lambda: _all_free(prefill), FREED_WITHIN_S)
    assert wait_for(lambda: _all_free(decode), FREED_WITHIN_S)


def test_unclaimed_reservation_expires_and_frees_its_blocks(
    workers: dict[str, WorkerProc], prompt: list[int]
) -> None:
    decode = workers["decode-short"]
    assert wait_for(lambda: _all_free(decode), FREED_WITHIN_S)
    destination = _reserve(decode, "never-sent", prompt)
    assert decode.stats().free_blocks == NUM_BLOCKS - len(destination.block_ids)
    assert wait_for(lambda: _all_free(decode), FREED_WITHIN_S), "the reservation expired"
    first = common_pb2.TokenChunk(token_ids=[42])
    code, details = _code(
        lambda: list(decode.stub.Decode(_decode_request("never-sent", prompt, first, 5.0)))
    )
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "never-sent" in details


def test_decode_gives_up_when_the_transfer_never_arrives(
    workers: dict[str, WorkerProc], prompt: list[int]
) -> None:
    decode = workers["decode-short"]
    _reserve(decode, "late-kv", prompt)
    first = common_pb2.TokenChunk(token_ids=[42])
    request = _decode_request("late-kv", prompt, first, 0.5)
    code, details = _code(lambda: list(decode.stub.Decode(request, timeout=30)))
    assert code is grpc.StatusCode.UNAVAILABLE
    assert "did not complete within 0.5s" in details and "late-kv" in details
    assert wait_for(lambda: _all_free(decode), FREED_WITHIN_S)


def test_cancel_frees_a_reservation_and_a_running_stream(
    workers: dict[str, WorkerProc], prompt: list[int]
) -> None:
    decode = workers["decode-short"]
    _reserve(decode, "cancel-me", prompt)
    reply = decode.stub.Cancel(worker_pb2.CancelRequest(request_id="cancel-me"), timeout=10)
    assert reply.found
    stream = decode.stub.Generate(
        worker_pb2.GenerateRequest(
            request_id="gen-cancel", prompt_token_ids=prompt, params=greedy(24, ignore_eos=True)
        ),
        timeout=60,
    )
    assert len(next(stream).token_ids) == 1
    decode.stub.Cancel(worker_pb2.CancelRequest(request_id="gen-cancel"), timeout=10)
    rest = list(stream)
    assert rest and rest[-1].finish_reason == "abort"
    assert len(rest) < 24
    assert wait_for(lambda: _all_free(decode), FREED_WITHIN_S)


def test_a_dropped_stream_aborts_its_request(
    workers: dict[str, WorkerProc], prompt: list[int]
) -> None:
    decode = workers["decode-short"]
    request = worker_pb2.GenerateRequest(
        request_id="dropped", prompt_token_ids=prompt, params=greedy(24, ignore_eos=True)
    )
    stream = decode.stub.Generate(request, timeout=60)
    next(stream)
    stream.cancel()
    assert wait_for(lambda: _all_free(decode), FREED_WITHIN_S)
    stats = decode.stats()
    assert stats.generated_tokens > 0 and stats.running == 0


BAD_PARAMS = (
    (common_pb2.SamplingParams(top_p=0.0), "top_p"),
    (common_pb2.SamplingParams(temperature=-1.0), "temperature"),
    (common_pb2.SamplingParams(max_tokens=10**6), "max_tokens"),
    (common_pb2.SamplingParams(n=99), "n must be"),
)


@pytest.mark.parametrize(("params", "field"), BAD_PARAMS)
def test_bad_params_are_invalid_argument(
    workers: dict[str, WorkerProc], prompt: list[int], params: Any, field: str
) -> None:
    worker = workers["prefill-slow"]
    request = worker_pb2.GenerateRequest(request_id="bad", prompt_token_ids=prompt, params=params)
    code, details = _code(lambda: list(worker.stub.Generate(request, timeout=30)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and field in details, details


def _generate_call(worker: WorkerProc, request_id: str, prompt: list[int]) -> Any:
    request = worker_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, params=greedy(2)
    )
    return lambda: list(worker.stub.Generate(request, timeout=30))


def test_bad_requests_are_refused_and_the_workers_keep_serving(
    workers: dict[str, WorkerProc], prompt: list[int]
) -> None:
    prefill, decode = workers["prefill-slow"], workers["decode-short"]
    no_destination = worker_pb2.PrefillRequest(
        request_id="nodest", prompt_token_ids=prompt, params=greedy(2)
    )
    calls = {
        "token out of range": _generate_call(prefill, "oov", [10**6]),
        "empty prompt": _generate_call(prefill, "empty", []),
        "empty request id": _generate_call(prefill, "", prompt),
        "no destination": lambda: list(prefill.stub.Prefill(no_destination, timeout=30)),
        "empty reserve": lambda: decode.stub.ReserveKV(
            worker_pb2.ReserveKVRequest(request_id="empty-reserve"), timeout=30
        ),
    }
    for what, call in calls.items():
        code, details = _code(call)
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
    tokens, _ = run_generate(prefill, "good-after-bad", prompt, greedy(4))
    assert len(tokens[0]) == 4
    result = run_disaggregated(prefill, decode, "good-disagg", prompt, greedy(4))
    assert len(result.token_ids) == 4 and result.report is not None and result.report.ok
