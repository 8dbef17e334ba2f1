"""The worker's edge: protobuf messages <-> engine types, converted once per call.

Shared by both worker roles (the decode worker imports it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.outputs import StepOutput
from engine.sampling_params import SamplingParams
from pdserve_proto import common_pb2, worker_pb2

if TYPE_CHECKING:
    from engine.async_engine import EngineStats
    from kv_transfer import TransferStats

MAX_REQUEST_ID_CHARS = 200


@dataclass(slots=True, frozen=True)
class KVDestination:
    """Where a prefill sends a prompt's KV: the decode worker's reservation.

    ``block_ids[i]`` receives prompt block ``i``; the first ``num_present_blocks`` are
    already there (its prefix cache), so they are not sent.
    """

    worker_id: str
    backend: str
    agent_metadata: bytes
    block_ids: tuple[int, ...]
    num_present_blocks: int
    transfer_id: str


def check_request_id(request_id: str) -> str:
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise ValueError(
            f"request_id must be 1..{MAX_REQUEST_ID_CHARS} printable characters, got "
            f"{request_id[:40]!r} ({len(request_id)} characters)"
        )
    return request_id


def prompt_from_proto(token_ids: Sequence[int]) -> list[int]:
    """The prompt as a list; the engine checks the vocabulary range and the context length."""
    if not token_ids:
        raise ValueError("prompt_token_ids is empty: give at least one token id")
    return list(token_ids)


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine defaults; ValueError names a bad field."""
    defaults = SamplingParams()
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else defaults.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=(
            msg.repetition_penalty
            if msg.HasField("repetition_penalty")
            else defaults.repetition_penalty
        ),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        n=msg.n if msg.HasField("n") else defaults.n,
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


def destination_to_proto(dest: KVDestination) -> worker_pb2.KVDestination:
    return worker_pb2.KVDestination(
        worker_id=dest.worker_id,
        backend=dest.backend,
        agent_metadata=dest.agent_metadata,
        block_ids=dest.block_ids,
        num_present_blocks=dest.num_present_blocks,
        transfer_id=dest.transfer_id,
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
            f"the first token already finished the request ({chunk.finish_reason!r}); "
            "there is nothing to decode"
        )
    return int(chunk.token_ids[0])


def step_to_chunk(out: StepOutput) -> common_pb2.TokenChunk:
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
    return msg
