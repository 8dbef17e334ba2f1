"""The worker's pure pieces, in milliseconds (no model, no processes): transfer planning,
the reservation table, proto conversion, the error -> status mapping, handle waiting.

(They sit beside the worker process tests; they belong with tests/unit as well.)
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from pdserve.decode_worker.reservations import Reservation, ReservationTable
from pdserve.engine.engine_stats import EngineStats, SpeculationCounts, speculation_counts
from pdserve.engine.outputs import StepOutput, TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.ngram import NgramProposer
from pdserve.engine.speculative.speculator import Speculator
from pdserve.kv_transfer import TransferHandle, TransferState
from pdserve.kv_transfer.handoff import (
    KVDestination,
    PreconditionFailed,
    RequestCancelled,
    TransferFailed,
    TransferTimedOut,
    await_handle,
)
from pdserve.prefill_worker.transfer import plan_transfer
from pdserve.proto import common_pb2, worker_pb2
from pdserve.proto.params import params_from_proto, params_to_proto
from pdserve.worker.checks import check_prompt, check_request_id
from pdserve.worker.convert import (
    destination_from_proto,
    destination_to_proto,
    first_token_from_proto,
    stats_to_proto,
    step_to_chunk,
)
from pdserve.worker.errors import status_for


def _dest(block_ids: tuple[int, ...], present: int) -> KVDestination:
    return KVDestination("d0", "nixl", b"meta", block_ids, present, "t1")


def test_plan_skips_the_blocks_the_receiver_holds() -> None:
    plan = plan_transfer((17, 4, 30, 9, 12), _dest((2, 8, 51, 60, 61), 2))
    assert plan.src_block_ids == (30, 9, 12)
    assert plan.dst_block_ids == (51, 60, 61)
    assert (plan.blocks_skipped, plan.transfer_id, plan.peer) == (2, "t1", b"meta")
    assert plan_transfer((1, 2), _dest((5, 6), 2)).empty


def test_plan_refuses_tables_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="fills 3 blocks here but the destination reserved 2"):
        plan_transfer((1, 2, 3), _dest((5, 6), 0))


def _reservation(request_id: str, expires_at_s: float) -> Reservation:
    return Reservation(request_id, f"{request_id}#x", (1, 2), (7,), 0, None, expires_at_s)


def test_reservation_table_claims_once_and_expires_only_unclaimed() -> None:
    table = ReservationTable()
    table.add(_reservation("a", 10.0))
    table.add(_reservation("b", 10.0))
    table.add(_reservation("c", 99.0))
    with pytest.raises(ValueError, match="already holds a KV reservation"):
        table.add(_reservation("a", 10.0))
    claimed = table.claim("a")
    assert claimed is not None and claimed.claimed and table.claim("a") is None
    assert [r.request_id for r in table.take_expired(now_s=10.0)] == ["b"]
    assert len(table) == 2 and "b" not in table
    assert table.pop("a") is claimed and table.claim("zzz") is None


def test_unset_proto_params_take_the_engine_defaults() -> None:
    assert params_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    msg = common_pb2.SamplingParams(max_tokens=3, temperature=0.0, seed=7, stop=["x"], n=2)
    params = params_from_proto(msg)
    assert (params.max_tokens, params.temperature, params.seed, params.stop, params.n) == (
        3,
        0.0,
        7,
        ("x",),
        2,
    )
    with pytest.raises(ValueError, match="top_p"):
        params_from_proto(common_pb2.SamplingParams(top_p=0.0))


def test_destination_and_first_token_are_checked_at_the_edge() -> None:
    good = worker_pb2.KVDestination(
        worker_id="d", backend="tcp", agent_metadata=b"m", block_ids=[4, 5], transfer_id="t"
    )
    assert destination_from_proto(good).block_ids == (4, 5)
    with pytest.raises(ValueError, match="num_present_blocks=3 exceeds its 2 block ids"):
        destination_from_proto(
            worker_pb2.KVDestination(
                agent_metadata=b"m", block_ids=[4, 5], transfer_id="t", num_present_blocks=3
            )
        )
    with pytest.raises(ValueError, match="exactly one token id"):
        first_token_from_proto(common_pb2.TokenChunk(token_ids=[1, 2]))
    with pytest.raises(ValueError, match="already finished"):
        first_token_from_proto(common_pb2.TokenChunk(token_ids=[1], finish_reason="stop"))
    assert first_token_from_proto(common_pb2.TokenChunk(token_ids=[9])) == 9


def test_each_worker_error_has_one_status_code() -> None:
    assert status_for(ValueError("x")) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(PreconditionFailed("x")) is grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(RequestCancelled("x")) is grpc.StatusCode.CANCELLED
    assert status_for(TransferFailed("x")) is grpc.StatusCode.ABORTED
    assert status_for(TransferTimedOut("x")) is grpc.StatusCode.UNAVAILABLE
    assert status_for(KeyError("x")) is grpc.StatusCode.INTERNAL


def test_await_handle_returns_done_times_out_or_is_cancelled() -> None:
    async def scenario() -> None:
        done = TransferHandle("t-done")
        done.start()
        threading.Timer(0.01, lambda: done.succeed(64)).start()
        assert await await_handle(done, timeout_s=5.0) is TransferState.DONE
        assert await await_handle(TransferHandle("t-slow"), 0.01) is TransferState.PENDING
        cancelled = asyncio.Event()
        cancelled.set()
        with pytest.raises(RequestCancelled, match="t-cancel"):
            await await_handle(TransferHandle("t-cancel"), 5.0, cancelled)

    asyncio.run(scenario())


def test_sampling_params_read_from_the_wire_keep_engine_defaults() -> None:
    msg = common_pb2.SamplingParams(temperature=0.0, top_k=5, stop_token_ids=[7], logprobs=0)
    params = params_from_proto(msg)
    assert params_from_proto(params_to_proto(params)) == params
    assert (params.temperature, params.top_k, params.stop_token_ids, params.logprobs) == (
        0.0,
        5,
        (7,),
        0,
    )
    assert params.max_tokens == SamplingParams().max_tokens  # unset: the engine default


def test_speculation_opt_out_round_trips_and_defaults_stay_unset() -> None:
    assert not params_to_proto(SamplingParams()).HasField("speculative")
    opted_out = SamplingParams(temperature=0.0, speculative=False)
    msg = params_to_proto(opted_out)
    assert msg.HasField("speculative") and msg.speculative is False
    assert params_from_proto(msg) == opted_out
    assert params_from_proto(common_pb2.SamplingParams(speculative=True)).speculative is True


def test_speculation_counters_reach_get_stats_with_one_count_per_acceptance_length() -> None:
    assert speculation_counts(None) == SpeculationCounts()
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    speculator = Speculator(config, NgramProposer(config))
    speculator.stats.verify_steps = 3
    speculator.stats.proposed_tokens = 9
    speculator.stats.accepted_tokens = 2
    speculator.stats.branch_accepted_tokens = 1
    speculator.stats.acceptance_lengths.update({0: 2, 2: 1})
    counts = speculation_counts(speculator)
    assert counts.acceptance_length_counts == (2, 0, 1, 0)  # lengths 0..3
    engine = EngineStats(
        waiting=0, running=1, held=0, pending_admissions=0, free_blocks=8, cached_blocks=0,
        total_blocks=8, prefix_hit_tokens=0, prefix_queried_tokens=0, prompt_tokens=5,
        generated_tokens=4, speculation=counts,
    )  # fmt: skip
    msg = stats_to_proto(engine, None, worker_id="d0", role="decode", epoch=1)
    assert (
        msg.spec_verify_steps,
        msg.spec_proposed_tokens,
        msg.spec_accepted_tokens,
        msg.spec_branch_accepted_tokens,
        list(msg.spec_acceptance_length_counts),
    ) == (3, 9, 2, 1, [2, 0, 1, 0])


def test_step_output_becomes_a_token_chunk() -> None:
    lp = TokenLogprob(token_id=5, logprob=-0.25, top=((5, -0.25), (9, -2.0)))
    running = StepOutput("r", 1, (5,), "hi", (lp,), None)
    chunk = step_to_chunk(running)
    assert (chunk.index, list(chunk.token_ids), chunk.text, chunk.finish_reason) == (
        1,
        [5],
        "hi",
        "",
    )
    (wire_lp,) = chunk.logprobs
    assert (wire_lp.token_id, wire_lp.logprob) == (5, -0.25)
    assert (list(wire_lp.top_token_ids), list(wire_lp.top_logprobs)) == ([5, 9], [-0.25, -2.0])
    assert step_to_chunk(StepOutput("r", 0, (), "", (), "stop")).finish_reason == "stop"


def test_destination_round_trips_between_the_roles() -> None:
    dest = _dest((3, 4, 5), 1)
    assert destination_from_proto(destination_to_proto(dest)) == dest


def test_request_id_and_prompt_are_checked_at_the_edge() -> None:
    assert check_request_id("req-1") == "req-1"
    for bad in ("", "x" * 201, "tab\there"):
        with pytest.raises(ValueError, match=r"request_id must be 1\.\.200 printable"):
            check_request_id(bad)
    assert check_prompt((1, 2)) == [1, 2]
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        check_prompt(())
