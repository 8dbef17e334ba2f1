"""The decode worker's edge: its protobuf messages <-> engine and KV-handoff types.

Shared pieces come from ``engine.wire_fields`` and ``kv_transfer.handoff`` (the decode role
imports nothing of the prefill role's package).
"""

from __future__ import annotations

from engine.outputs import StepOutput
from engine.sampling_params import SamplingParams
from engine.wire_fields import chunk_fields
from kv_transfer.handoff import KVDestination
from pdserve_proto import common_pb2, worker_pb2


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine defaults; ValueError names a bad field."""
    return SamplingParams.from_fields({f.name: value for f, value in msg.ListFields()})


def step_to_chunk(out: StepOutput) -> common_pb2.TokenChunk:
    return common_pb2.TokenChunk(**chunk_fields(out))


def first_token_from_proto(chunk: common_pb2.TokenChunk) -> int:
    """The one token the prefill worker sampled; ValueError if the chunk is not that."""
    if len(chunk.token_ids) != 1:
        raise ValueError(
            f"first_token must carry exactly one token id (the prefill worker's), got "
            f"{list(chunk.token_ids)[:4]}"
        )
    if chunk.finish_reason:
        raise ValueError(
            f"the first token already finished the request ({chunk.finish_reason!r}); "
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
