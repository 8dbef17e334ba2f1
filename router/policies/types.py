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
class WorkerCandidate:
    worker_id: str
    role: WorkerRole
    load: WorkerLoad = field(default_factory=WorkerLoad)


@dataclass(slots=True, frozen=True)
class CostModel:
    """The figures a TTFT prediction is made of.

    Defaults fit SmolLM2-135M on a CPU: 30 layers x K,V x 3 KV heads x 64 dims x 2 bytes
    = 23,040 KV bytes per token, and a loopback link.
    """

    prefill_s_per_token: float = 2e-4
    decode_admission_s: float = 1e-3
    kv_bytes_per_token: int = 23_040
    link_bytes_per_s: float = 1e9
    # Added when a decode worker reported fewer free blocks than the prompt needs: it will
    # most likely refuse the reservation, so it is tried only after the ones that fit.
    no_room_penalty_s: float = 10.0

    def __post_init__(self) -> None:
        if self.prefill_s_per_token < 0 or self.decode_admission_s < 0:
            raise ValueError(f"cost model times must be >= 0, got {self}")
        if self.kv_bytes_per_token <= 0 or self.link_bytes_per_s <= 0:
            raise ValueError(f"kv_bytes_per_token and link_bytes_per_s must be > 0, got {self}")


@dataclass(slots=True, frozen=True)
class RouteRequest:
    """One request as routing sees it.

    ``cached_blocks`` maps worker id -> leading prompt blocks that worker holds (locality
    index) or was just sent by this router (router/state/placements.py); missing = 0.
    ``new_blocks`` maps worker id -> blocks of new prefix this router gave it lately.
    """

    prompt_tokens: int
    block_size: int = 16
    cached_blocks: Mapping[str, int] = field(default_factory=dict)
    new_blocks: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.prompt_tokens >= 1, f"prompt_tokens must be >= 1, got {self.prompt_tokens}"
        assert self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}"

    @property
    def prompt_blocks(self) -> int:
        """Full blocks of the prompt: only those are hashed and can be cached."""
        return self.prompt_tokens // self.block_size

    @property
    def blocks_needed(self) -> int:
        """Blocks a decode worker must reserve to hold the prompt's KV (partial block too)."""
        return -(-self.prompt_tokens // self.block_size)

    def cached_tokens(self, worker_id: str) -> int:
        blocks = min(self.cached_blocks.get(worker_id, 0), self.prompt_blocks)
        return blocks * self.block_size


@dataclass(slots=True, frozen=True)
class RouteDecision:
    """Where one request goes. ``decode_worker_id`` is None for colocated serving."""

    prefill_worker_id: str
    decode_worker_id: str | None
    ttft_s: float  # predicted
    policy: str
    reason: str

    @property
    def colocated(self) -> bool:
        return self.decode_worker_id is None


class RoutingPolicy(Protocol):
    """Ranks the places a request could go, best first; an empty list means no workers."""

    name: str

    def rank(
        self, request: RouteRequest, workers: Sequence[WorkerCandidate]
    ) -> list[RouteDecision]: ...
