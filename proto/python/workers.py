"""The words every process uses for a worker: its role, its load and its registration.

The registry (cluster/) stores them in Redis, the workers publish them, the router routes on
them. Plain frozen dataclasses: no torch, no Redis, no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class WorkerRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # runs both phases: the baseline and the one-worker deployment


@dataclass(slots=True, frozen=True)
class WorkerLoad:
    """What a worker is busy with, as its heartbeat or its ``GetStats`` reports it.

    ``free_blocks`` is None when the worker did not report it; ``extra`` holds free-form
    gauges (name, value) such as ``kv_usage``.
    """

    waiting: int = 0
    running: int = 0
    free_blocks: int | None = None
    queued_prefill_tokens: int = 0
    extra: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        counts = (self.waiting, self.running, self.free_blocks or 0, self.queued_prefill_tokens)
        if min(counts) < 0:
            raise ValueError(
                f"load counts must be >= 0, got (waiting, running, free_blocks, "
                f"queued_prefill_tokens)={counts}"
            )

    @property
    def requests(self) -> int:
        return self.waiting + self.running


@dataclass(slots=True, frozen=True)
class WorkerInfo:
    """One worker: where it serves and what it holds.

    ``epoch`` is the registration's incarnation number (0: not registered yet, or a worker
    listed by hand); ``kv_capacity_blocks`` 0 means unknown. ``model`` "" serves any name.
    """

    worker_id: str
    role: WorkerRole
    address: str  # host:port of its Worker gRPC service
    model: str = ""
    kv_capacity_blocks: int = 0
    block_size: int = 16
    epoch: int = 0
    load: WorkerLoad = WorkerLoad()

    def __post_init__(self) -> None:
        if self.role not in {r.value for r in WorkerRole}:
            roles = [r.value for r in WorkerRole]
            raise ValueError(f"role must be one of {roles}, got {self.role!r}")
        # Accept the plain string too ("prefill"), stored as the enum.
        object.__setattr__(self, "role", WorkerRole(self.role))
        if not self.worker_id or not self.address:
            raise ValueError(
                f"worker_id and address must be non-empty, got {self.worker_id!r}, {self.address!r}"
            )
        if self.kv_capacity_blocks < 0 or self.block_size <= 0 or self.epoch < 0:
            raise ValueError(
                "kv_capacity_blocks and epoch must be >= 0 and block_size > 0, got "
                f"{self.kv_capacity_blocks}, {self.block_size}, {self.epoch}"
            )
