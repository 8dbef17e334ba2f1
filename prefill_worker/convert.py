"""The prefill worker's edge: protobuf messages <-> engine types, converted once per call.

The pieces the decode role needs too live where both roles may import them (engine,
kv_transfer) and are re-exported here; ``stats_to_proto`` serves both roles' GetStats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.outputs import StepOutput
from engine.sampling_params import SamplingParams
from engine.wire_fields import check_prompt, check_request_id, chunk_fields
from kv_transfer.handoff import KVDestination
from pdserve_proto import common_pb2, worker_pb2

if TYPE_CHECKING:
    from engine.async_engine import EngineStats
    from kv_transfer import TransferStats

__all__ = [
    "KVDestination",
    "check_request_id",
    "destination_from_proto",
    "params_from_proto",
    "prompt_from_proto",
    "stats_to_proto",
    "step_to_chunk",
]

prompt_from_proto = check_prompt


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine defaults; ValueError names a bad field."""
    return SamplingParams.from_fields({f.name: value for f, value in msg.ListFields()})


def step_to_chunk(out: StepOutput) -> common_pb2.TokenChunk:
    return common_pb2.TokenChunk(**chunk_fields(out))


def destination_from_proto(msg: worker_pb2.KVDestination) -> KVDestination:
    block_ids = tuple(msg.block_ids)
    if not block_ids or not msg.transfer_id or not msg.agent_metadata:
        raise ValueError(
            "destination needs block_ids, transfer_id and agent_metadata (pass the decode "
            f"worker's ReserveKV answer as is); got {len(block_ids)} block ids, transfer_id "
            f"{msg.transfer_id!r}, {len(msg.agent_metadata)} metadata bytes"
        )
    if msg.num_present_blocks > len(block_ids):
        raise ValueError(
            f"destination num_present_blocks={msg.num_present_blocks} exceeds its "
            f"{len(block_ids)} block ids"
        )
    return KVDestination(
        msg.worker_id,
        msg.backend,
        bytes(msg.agent_metadata),
        block_ids,
        msg.num_present_blocks,
        msg.transfer_id,
    )


def stats_to_proto(
    engine: EngineStats,
    transfer: TransferStats | None,
    *,
    worker_id: str,
    role: str,
    epoch: int,
) -> worker_pb2.WorkerStats:
    """GetStats' answer. Transfer bytes count both directions (a worker has one role)."""
    msg = worker_pb2.WorkerStats(
        worker_id=worker_id,
        role=role,
        epoch=epoch,
        waiting=engine.waiting + engine.pending_admissions,
        running=engine.running,
        free_blocks=engine.free_blocks,
        cached_blocks=engine.cached_blocks,
        total_blocks=engine.total_blocks,
        prefix_hit_tokens=engine.prefix_hit_tokens,
        prompt_tokens=engine.prompt_tokens,
        generated_tokens=engine.generated_tokens,
    )
    if transfer is not None:
        msg.transfer_bytes = transfer.bytes_sent + transfer.bytes_received
        msg.transfers_ok = transfer.transfers_ok
        msg.transfers_failed = transfer.transfers_failed
        msg.transfers_in_flight = transfer.transfers_in_flight
    return msg
