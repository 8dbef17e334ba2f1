"""Both worker roles' edge: their protobuf messages <-> engine and KV-handoff types, converted
once per call. Sampling parameters convert in ``pdserve.proto.params`` (the router uses it too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.outputs import StepOutput
from pdserve.kv_transfer.handoff import KVDestination
from pdserve.proto import common_pb2, worker_pb2

if TYPE_CHECKING:
    from pdserve.engine.async_engine import EngineStats
    from pdserve.engine.kv_cache.tiers import TierStats
    from pdserve.kv_transfer import TransferStats


def step_to_chunk(out: StepOutput) -> common_pb2.TokenChunk:
    """A step's output as a ``TokenChunk`` (``finish_reason`` "" = still running)."""
    return common_pb2.TokenChunk(
        index=out.index,
        token_ids=out.token_ids,
        text=out.text,
        logprobs=[
            common_pb2.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top_token_ids=[t for t, _ in lp.top],
                top_logprobs=[p for _, p in lp.top],
            )
            for lp in out.logprobs
        ],
        finish_reason=out.finish_reason or "",
    )


def first_token_from_proto(chunk: common_pb2.TokenChunk) -> int:
    """The one token the prefill worker sampled; ValueError if the chunk is not that."""
    if len(chunk.token_ids) != 1:
        raise ValueError(
            f"first_token must carry exactly one token id (the prefill worker's), got "
            f"{list(chunk.token_ids)[:4]}"
        )
    if chunk.finish_reason:
        raise ValueError(
            f"first_token already finished the request ({chunk.finish_reason!r}); "
            "there is nothing to decode"
        )
    return int(chunk.token_ids[0])


def destination_to_proto(dest: KVDestination) -> worker_pb2.KVDestination:
    return worker_pb2.KVDestination(
        worker_id=dest.worker_id,
        backend=dest.backend,
        agent_metadata=dest.agent_metadata,
        block_ids=dest.block_ids,
        num_present_blocks=dest.num_present_blocks,
        transfer_id=dest.transfer_id,
    )


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
    """GetStats' answer. Transfer bytes count both directions (a worker has one role; a
    prefill worker receives only what it fetches from peers)."""
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
        spec_verify_steps=engine.speculation.verify_steps,
        spec_proposed_tokens=engine.speculation.proposed_tokens,
        spec_accepted_tokens=engine.speculation.accepted_tokens,
        spec_branch_accepted_tokens=engine.speculation.branch_accepted_tokens,
        spec_acceptance_length_counts=engine.speculation.acceptance_length_counts,
        host_tier=_tier_to_proto(engine.tiers, "host"),
        disk_tier=_tier_to_proto(engine.tiers, "disk"),
        disk_tier_stopped=engine.tiers.disk_stopped,
    )
    if transfer is not None:
        msg.transfer_bytes = transfer.bytes_sent + transfer.bytes_received
        msg.transfers_ok = transfer.transfers_ok
        msg.transfers_failed = transfer.transfers_failed
        msg.transfers_in_flight = transfer.transfers_in_flight
    return msg


def _tier_to_proto(tiers: TierStats, tier: str) -> worker_pb2.KVTierStats:
    """One tier's counters out of ``TierStats`` (its fields are named ``{tier}_...``)."""
    return worker_pb2.KVTierStats(
        hit_tokens=getattr(tiers, f"{tier}_hit_tokens"),
        stored_blocks=getattr(tiers, f"{tier}_stored_blocks"),
        bytes_in=getattr(tiers, f"{tier}_bytes_in"),
        bytes_out=getattr(tiers, f"{tier}_bytes_out"),
        used_bytes=getattr(tiers, f"{tier}_used_bytes"),
    )
