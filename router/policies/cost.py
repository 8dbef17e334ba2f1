"""Shared pieces of every policy: splitting workers into pools, load order, TTFT prediction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.proto.workers import WorkerRole
from pdserve.router.policies.types import (
    CostModel,
    PeerFetch,
    PrefixHit,
    RouteRequest,
    WorkerCandidate,
)


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
    load_s: float = 0.0  # cached blocks loaded back into the prefill worker's pool
    fetch_s: float = 0.0  # blocks pulled from a peer before the prefill
    compute_tokens: int = 0  # prompt tokens the prefill worker computes

    @property
    def total_s(self) -> float:
        return (
            self.queue_s
            + self.load_s
            + self.fetch_s
            + self.prefill_s
            + self.transfer_s
            + self.admission_s
        )


def tier_load_s(hit: PrefixHit, cost: CostModel) -> float:
    """Loading a hit's blocks that live below the pool back into it (pool blocks: free)."""
    return (
        hit.host_blocks * cost.host_load_s_per_block + hit.disk_blocks * cost.disk_load_s_per_block
    )


def link_bytes_per_s(request: RouteRequest, sender: str, receiver: str, cost: CostModel) -> float:
    """The link's measured KV rate; for a link not measured, the cost model's default or
    twice the fastest measured link, whichever is faster.

    The optimism is what gets a link measured: priced at the default, a link would never be
    tried once another measured faster than that (a same-host one, say), and its rate never
    learnt. So the next prompt long enough for links to matter tries it, once; a slow link
    forgotten after ``LinkRates.max_age_s`` is tried again the same way.
    """
    measured = request.link_rates.get((sender, receiver))
    if measured is not None:
        return measured
    return max(cost.link_bytes_per_s, 2.0 * request.fastest_link_bytes_per_s)


def fetch_s(request: RouteRequest, prefill: str, holder: WorkerCandidate, cost: CostModel) -> float:
    """A peer fetch by ``prefill`` of what ``holder`` holds beyond its own hit: setup, the
    holder's current step (it pins the blocks between steps), the holder loading its blocks
    below the pool, and the blocks ``prefill`` lacks over the link."""
    held = request.hit(holder.worker_id)
    fetched = request.blocks_to_tokens(request.fetchable_blocks(holder.worker_id))
    moved_tokens = max(0, fetched - request.cached_tokens(prefill))
    busy_tokens = min(holder.load.queued_prefill_tokens, cost.step_tokens)
    rate = link_bytes_per_s(request, holder.worker_id, prefill, cost)
    return (
        cost.peer_fetch_setup_s
        + busy_tokens * cost.prefill_s_per_token
        + tier_load_s(held, cost)
        + moved_tokens * cost.kv_bytes_per_token / rate
    )


def choose_fetch(
    request: RouteRequest,
    prefill: WorkerCandidate,
    peers: Sequence[WorkerCandidate],
    cost: CostModel,
) -> PeerFetch | None:
    """The peer whose held prefix saves ``prefill`` the most time net of fetching it, or
    None when computing (after its own hit) is at least as fast as every fetch."""
    # The last prompt token is always computed: no hit covers it.
    own = min(request.cached_tokens(prefill.worker_id), request.prompt_tokens - 1)
    best: tuple[float, PeerFetch] | None = None
    for peer in peers:
        held = request.fetchable_blocks(peer.worker_id)
        covered = min(request.blocks_to_tokens(held), request.prompt_tokens - 1)
        if peer.worker_id == prefill.worker_id or covered <= own:
            continue
        saved_s = (covered - own) * cost.prefill_s_per_token
        gain_s = saved_s - fetch_s(request, prefill.worker_id, peer, cost)
        if gain_s > 0 and (best is None or gain_s > best[0]):
            best = (gain_s, PeerFetch(peer.worker_id, min(held, request.prompt_blocks)))
    return best[1] if best is not None else None


def predict_ttft(
    request: RouteRequest,
    prefill: WorkerCandidate,
    decode: WorkerCandidate | None,
    cost: CostModel,
    fetch: PeerFetch | None = None,
    holder: WorkerCandidate | None = None,
) -> TtftEstimate:
    """queue wait + loading the cached blocks below the pool + (fetching a peer's prefix)
    + uncached prefill tokens x per-token cost + KV bytes / link + admission.

    ``fetch`` (with its ``holder``) is a peer fetch ahead of the prefill (``choose_fetch``).
    """
    own = request.hit(prefill.worker_id)
    queue_s = prefill.load.queued_prefill_tokens * cost.prefill_s_per_token
    load_s = tier_load_s(own, cost)
    covered = request.cached_tokens(prefill.worker_id)
    fetched_s = 0.0
    if fetch is not None:
        assert holder is not None and holder.worker_id == fetch.holder_id, (
            f"a fetch from {fetch.holder_id!r} needs that holder's candidate, got {holder!r}"
        )
        fetched_s = fetch_s(request, prefill.worker_id, holder, cost)
        covered = request.blocks_to_tokens(fetch.num_blocks)
    # The last prompt token is always computed: its logits give the first token.
    compute = request.prompt_tokens - min(covered, request.prompt_tokens - 1)
    prefill_s = compute * cost.prefill_s_per_token
    if decode is None or decode.worker_id == prefill.worker_id:
        return TtftEstimate(queue_s, prefill_s, 0.0, 0.0, load_s, fetched_s, compute)
    # The prefill worker skips the leading blocks the decode worker already holds.
    kv_tokens = request.prompt_tokens - request.cached_tokens(decode.worker_id)
    rate = link_bytes_per_s(request, prefill.worker_id, decode.worker_id, cost)
    transfer_s = kv_tokens * cost.kv_bytes_per_token / rate
    admission_s = cost.decode_admission_s * (1 + decode.load.waiting)
    if not has_room(request, decode):
        admission_s += cost.no_room_penalty_s
    return TtftEstimate(queue_s, prefill_s, transfer_s, admission_s, load_s, fetched_s, compute)


def describe(request: RouteRequest, worker: WorkerCandidate) -> str:
    """A short account of one worker for a decision's reason."""
    hit = request.hit(worker.worker_id)
    below = ""
    if hit.host_blocks or hit.disk_blocks:
        below = f", {hit.host_blocks} in host memory, {hit.disk_blocks} on disk"
    return (
        f"{worker.worker_id} (load {worker.load.requests}, "
        f"cached {min(hit.blocks, request.prompt_blocks)}/{request.prompt_blocks} blocks{below})"
    )
