"""Shared pieces of every policy: splitting workers into pools, load order, TTFT prediction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.proto.workers import WorkerRole
from pdserve.router.policies.types import CostModel, RouteRequest, WorkerCandidate


@dataclass(slots=True, frozen=True)
class Pools:
    """Where a request can go: (prefill, decode) pairs, or single colocated workers.

    Disaggregated serving needs both a prefill and a decode pool; when either is empty the
    request falls back to colocated workers, or, without any, to whichever workers remain
    (every worker serves the colocated Generate call).
    """

    prefill: tuple[WorkerCandidate, ...]
    decode: tuple[WorkerCandidate, ...]
    colocated: tuple[WorkerCandidate, ...]

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill) and bool(self.decode)

    @property
    def prompt_pool(self) -> tuple[WorkerCandidate, ...]:
        """The workers that would run the prompt: prefill when disaggregated, else colocated."""
        return self.prefill if self.disaggregated else self.colocated


def split_pools(workers: Sequence[WorkerCandidate]) -> Pools:
    prefill = tuple(w for w in workers if w.role is WorkerRole.PREFILL)
    decode = tuple(w for w in workers if w.role is WorkerRole.DECODE)
    colocated = tuple(w for w in workers if w.role is WorkerRole.COLOCATED)
    if prefill and decode:
        return Pools(prefill, decode, colocated)
    return Pools((), (), colocated or tuple(workers))


def load_key(worker: WorkerCandidate) -> tuple[int, int, int, str]:
    """Least busy first: requests, then queued prefill work, then most free blocks."""
    load = worker.load
    free = load.free_blocks if load.free_blocks is not None else 0
    return (load.requests, load.queued_prefill_tokens, -free, worker.worker_id)


def has_room(request: RouteRequest, decode: WorkerCandidate) -> bool:
    """False only when the worker reported fewer free blocks than the prompt needs."""
    free = decode.load.free_blocks
    return free is None or free >= request.blocks_needed


@dataclass(slots=True, frozen=True)
class TtftEstimate:
    queue_s: float
    prefill_s: float
    transfer_s: float
    admission_s: float

    @property
    def total_s(self) -> float:
        return self.queue_s + self.prefill_s + self.transfer_s + self.admission_s


def predict_ttft(
    request: RouteRequest,
    prefill: WorkerCandidate,
    decode: WorkerCandidate | None,
    cost: CostModel,
) -> TtftEstimate:
    """queue wait + uncached prefill tokens x per-token cost + KV bytes / link + admission."""
    # The last prompt token is always computed: its logits give the first token.
    cached_tokens = min(request.cached_tokens(prefill.worker_id), request.prompt_tokens - 1)
    queue_s = prefill.load.queued_prefill_tokens * cost.prefill_s_per_token
    prefill_s = (request.prompt_tokens - cached_tokens) * cost.prefill_s_per_token
    if decode is None or decode.worker_id == prefill.worker_id:
        return TtftEstimate(queue_s, prefill_s, 0.0, 0.0)
    # The prefill worker skips the leading blocks the decode worker already holds.
    kv_tokens = request.prompt_tokens - request.cached_tokens(decode.worker_id)
    transfer_s = kv_tokens * cost.kv_bytes_per_token / cost.link_bytes_per_s
    admission_s = cost.decode_admission_s * (1 + decode.load.waiting)
    if not has_room(request, decode):
        admission_s += cost.no_room_penalty_s
    return TtftEstimate(queue_s, prefill_s, transfer_s, admission_s)


def describe(request: RouteRequest, worker: WorkerCandidate) -> str:
    """A short account of one worker for a decision's reason."""
    cached = request.cached_blocks.get(worker.worker_id, 0)
    return (
        f"{worker.worker_id} (load {worker.load.requests}, "
        f"cached {min(cached, request.prompt_blocks)}/{request.prompt_blocks} blocks)"
    )
