"""Plain inputs and outputs of the routing policies (no grpc, no asyncio, no I/O).

The router converts what it learns from the worker directory and the locality index into
these dataclasses, asks a policy for a ranking, and walks the ranking: the first decision is
the choice, the later ones are where to go when a decode worker refuses a reservation
(back-pressure) or a worker fails before the first token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.proto.workers import WorkerLoad, WorkerRole


@dataclass(slots=True, frozen=True)
class PrefixHit:
    """The leading prompt blocks one worker holds (locality index), and how many of them
    live below its KV pool: int8 in host memory, or in files on disk. Those are loaded back
    into the pool before use; the rest are in the pool already."""

    blocks: int = 0
    host_blocks: int = 0
    disk_blocks: int = 0

    def __post_init__(self) -> None:
        assert 0 <= self.host_blocks + self.disk_blocks <= self.blocks, (
            f"a prefix hit of {self.blocks} blocks cannot have {self.host_blocks} in host "
            f"memory and {self.disk_blocks} on disk"
        )

    @property
    def pool_blocks(self) -> int:
        return self.blocks - self.host_blocks - self.disk_blocks


@dataclass(slots=True, frozen=True)
class WorkerCandidate:
    worker_id: str
    role: WorkerRole
    load: WorkerLoad = field(default_factory=WorkerLoad)


@dataclass(slots=True, frozen=True)
class CostModel:
    """The figures a TTFT prediction is made of.

    Defaults fit SmolLM2-135M on a CPU: 30 layers x K,V x 3 KV heads x 64 dims x 2 bytes
    = 23,040 KV bytes per token, and a loopback link. ``link_bytes_per_s`` is the rate of
    a link no transfer has measured yet, while no link is measured faster than half of it
    (``RouteRequest.link_rates`` holds the measured ones; cost.link_bytes_per_s).
    """

    prefill_s_per_token: float = 2e-4
    decode_admission_s: float = 1e-3
    kv_bytes_per_token: int = 23_040
    link_bytes_per_s: float = 1e9
    # Added when a decode worker reported fewer free blocks than the prompt needs: it will
    # most likely refuse the reservation, so it is tried only after the ones that fit.
    no_room_penalty_s: float = 10.0
    # Loading one cached block back into the pool from below it: a copy (exact codec) or a
    # dequantization (int8) from host memory; reading a block file and checking its CRC
    # first. Measured for fp32 SmolLM2 blocks (python -m pdserve.bench.kv_tiers): host
    # 0.06 ms exact, 0.14 ms int8; disk 0.45 ms, 0.27 ms; against ~3 ms to compute a block.
    host_load_s_per_block: float = 1e-4
    disk_load_s_per_block: float = 5e-4
    # A peer fetch's fixed part: the FetchKV call, the holder reserving the blocks, the
    # receiver's expectation (the same benchmark: 64 blocks in ~12 ms, 256 in ~37 ms).
    peer_fetch_setup_s: float = 0.005
    # A worker's largest step (its max_num_batched_tokens): a busy holder pins the blocks of
    # a fetch between two steps, so the fetch may wait for one step of at most this size.
    step_tokens: int = 2048

    def __post_init__(self) -> None:
        times = (
            self.prefill_s_per_token,
            self.decode_admission_s,
            self.host_load_s_per_block,
            self.disk_load_s_per_block,
            self.peer_fetch_setup_s,
        )
        if min(times) < 0 or self.step_tokens < 0:
            raise ValueError(f"cost model times and step_tokens must be >= 0, got {self}")
        if self.kv_bytes_per_token <= 0 or self.link_bytes_per_s <= 0:
            raise ValueError(f"kv_bytes_per_token and link_bytes_per_s must be > 0, got {self}")


@dataclass(slots=True, frozen=True)
class RouteRequest:
    """One request as routing sees it.

    ``prefix_hits`` maps worker id -> the leading prompt blocks that worker holds and where
    (locality index), or was just sent by this router (router/state/placements.py); missing
    = none. ``pending_blocks`` maps worker id -> how many of its hit's blocks only this
    router's placements vouch for (sent there, perhaps not computed yet): its own requests
    queue behind them, but a peer fetch asks only for what the index knows it holds.
    ``new_blocks`` maps worker id -> blocks of new prefix this router gave it lately.
    ``link_rates`` maps (sender, receiver) worker ids -> the KV bytes/s that link moved
    lately (router/state/link_rates.py); a link missing there is priced optimistically
    (``cost.link_bytes_per_s``).
    """

    prompt_tokens: int
    block_size: int = 16
    prefix_hits: Mapping[str, PrefixHit] = field(default_factory=dict)
    new_blocks: Mapping[str, int] = field(default_factory=dict)
    pending_blocks: Mapping[str, int] = field(default_factory=dict)
    link_rates: Mapping[tuple[str, str], float] = field(default_factory=dict)
    fastest_link_bytes_per_s: float = field(init=False, default=0.0)  # of ``link_rates``

    def __post_init__(self) -> None:
        assert self.prompt_tokens >= 1, f"prompt_tokens must be >= 1, got {self.prompt_tokens}"
        assert self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}"
        # Once per request, not per candidate pair routing prices.
        fastest = max(self.link_rates.values(), default=0.0)
        object.__setattr__(self, "fastest_link_bytes_per_s", fastest)

    @property
    def prompt_blocks(self) -> int:
        """Full blocks of the prompt: only those are hashed and can be cached."""
        return self.prompt_tokens // self.block_size

    @property
    def blocks_needed(self) -> int:
        """Blocks a decode worker must reserve to hold the prompt's KV (partial block too)."""
        return -(-self.prompt_tokens // self.block_size)

    def hit(self, worker_id: str) -> PrefixHit:
        return self.prefix_hits.get(worker_id, _NO_HIT)

    def fetchable_blocks(self, worker_id: str) -> int:
        """Leading blocks a peer may fetch from this worker: its hit, pending ones aside."""
        return self.hit(worker_id).blocks - self.pending_blocks.get(worker_id, 0)

    def cached_tokens(self, worker_id: str) -> int:
        return self.blocks_to_tokens(self.hit(worker_id).blocks)

    def blocks_to_tokens(self, num_blocks: int) -> int:
        return min(num_blocks, self.prompt_blocks) * self.block_size


_NO_HIT = PrefixHit()


@dataclass(slots=True, frozen=True)
class PeerFetch:
    """The prefill worker first pulls the prompt's leading ``num_blocks`` blocks from
    ``holder_id`` (over the KV transfer path; only those it lacks), then computes the rest."""

    holder_id: str
    num_blocks: int


@dataclass(slots=True, frozen=True)
class RouteDecision:
    """Where one request goes. ``decode_worker_id`` is None for colocated serving."""

    prefill_worker_id: str
    decode_worker_id: str | None
    ttft_s: float  # predicted
    policy: str
    reason: str
    fetch: PeerFetch | None = None
    # Prompt tokens the prefill worker is predicted to compute (its cache and a fetch
    # cover the rest): the router counts them as that worker's queued prefill work.
    compute_tokens: int | None = None
    queue_s: float = 0.0  # of ttft_s, the wait behind work the worker already has

    @property
    def colocated(self) -> bool:
        return self.decode_worker_id is None


class RoutingPolicy(Protocol):
    """Ranks the places a request could go, best first; an empty list means no workers."""

    name: str

    def rank(
        self, request: RouteRequest, workers: Sequence[WorkerCandidate]
    ) -> list[RouteDecision]: ...
