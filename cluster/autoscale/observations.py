"""What the planner sees each interval: the cluster's load and each pool's workers.

Plain frozen values, filled by whoever reads Redis (the goodput windows give the load, the
registry and the locality index give the workers). Times are on the caller's clock, the
same one it passes to :meth:`pdserve.cluster.autoscale.planner.Planner.decide` as ``now_s``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.cluster.pool_manager import MemberState


@dataclass(slots=True, frozen=True)
class LoadSample:
    """The request load over one window: arrival rate and mean tokens per request.

    ``mean_input_tokens`` counts the prompt, ``mean_output_tokens`` all generated tokens of
    a request. With no request in the window the means are 0 (and carry no information).
    """

    request_rate_per_s: float
    mean_input_tokens: float
    mean_output_tokens: float

    def __post_init__(self) -> None:
        values = (self.request_rate_per_s, self.mean_input_tokens, self.mean_output_tokens)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(
                "load must be finite and >= 0, got (request_rate_per_s, mean_input_tokens, "
                f"mean_output_tokens)={values}"
            )

    @classmethod
    def from_rates(
        cls, request_rate_per_s: float, input_tokens_per_s: float, output_tokens_per_s: float
    ) -> LoadSample:
        """From per-second totals, as a goodput window reports them (``request_rps``,
        ``prompt_tokens_per_s``, ``output_tokens_per_s``)."""
        if request_rate_per_s <= 0:
            return cls(0.0, 0.0, 0.0)
        return cls(
            request_rate_per_s,
            input_tokens_per_s / request_rate_per_s,
            output_tokens_per_s / request_rate_per_s,
        )

    @property
    def input_tokens_per_s(self) -> float:
        return self.request_rate_per_s * self.mean_input_tokens

    @property
    def output_tokens_per_s(self) -> float:
        return self.request_rate_per_s * self.mean_output_tokens


@dataclass(slots=True, frozen=True)
class WorkerObservation:
    """One worker of a pool.

    ``since_s``: when it entered ``state``; for a STARTING worker, when it was ordered, so
    the planner can tell capacity still arriving from a start that is overdue.
    ``kv_usage``: fraction of its KV blocks in use. ``cached_blocks``: blocks its prefix
    cache holds; ``unique_blocks``: those no other worker holds (the locality index's
    ``unique_blocks``), i.e. what the cluster loses by removing it.
    """

    worker_id: str
    state: MemberState
    since_s: float = 0.0
    running_requests: int = 0
    waiting_requests: int = 0
    kv_usage: float = 0.0
    cached_blocks: int = 0
    unique_blocks: int = 0

    def __post_init__(self) -> None:
        counts = (
            self.running_requests,
            self.waiting_requests,
            self.cached_blocks,
            self.unique_blocks,
        )
        if min(counts) < 0:
            raise ValueError(
                f"worker {self.worker_id!r}: counts must be >= 0, got (running, waiting, "
                f"cached_blocks, unique_blocks)={counts}"
            )
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"worker {self.worker_id!r}: kv_usage must be in [0, 1], got "
                             f"{self.kv_usage}")  # fmt: skip

    @property
    def is_active(self) -> bool:
        """Serving or about to: what ``plan_scale`` counts towards a pool's size."""
        return self.state in (MemberState.STARTING, MemberState.READY)


@dataclass(slots=True, frozen=True)
class PoolObservation:
    """One pool (prefill or decode) now.

    ``slo_attainment``: fraction of recent requests that met this pool's target (TTFT for
    prefill, TPOT for decode); ``observed_latency_s``: their mean TTFT (prefill) or
    inter-token latency (decode). None: no request finished recently.
    """

    workers: tuple[WorkerObservation, ...] = ()
    slo_attainment: float | None = None
    observed_latency_s: float | None = None

    def __post_init__(self) -> None:
        if self.slo_attainment is not None and not 0.0 <= self.slo_attainment <= 1.0:
            raise ValueError(f"slo_attainment must be in [0, 1], got {self.slo_attainment}")
        if self.observed_latency_s is not None and not self.observed_latency_s >= 0:
            raise ValueError(f"observed_latency_s must be >= 0, got {self.observed_latency_s}")


@dataclass(slots=True, frozen=True)
class ClusterObservation:
    """Everything one decision reads: the cluster-wide load and both pools."""

    load: LoadSample
    prefill: PoolObservation = PoolObservation()
    decode: PoolObservation = PoolObservation()


@dataclass(slots=True, frozen=True)
class PoolSummary:
    """A pool's workers folded into counts (see :func:`summarize`).

    ``arriving``: STARTING workers still within their expected start-up time, which count
    as capacity; ``overdue`` ones do not (the planner orders again for their load).
    ``kv_usage`` is the mean over ready workers, None without any.
    """

    ready: int
    arriving: int
    overdue: int
    running_requests: int
    waiting_requests: int
    kv_usage: float | None

    @property
    def starting(self) -> int:
        return self.arriving + self.overdue

    @property
    def active(self) -> int:
        """Ready + starting: the pool's size as ``plan_scale`` counts it."""
        return self.ready + self.starting

    @property
    def counted(self) -> int:
        """Replicas counted as capacity: ready ones and those arriving in time."""
        return self.ready + self.arriving


def summarize(
    workers: Iterable[WorkerObservation], now_s: float, overdue_after_s: float
) -> PoolSummary:
    """One pass over the workers (O(workers)). A STARTING worker ordered more than
    ``overdue_after_s`` ago is overdue."""
    ready = arriving = overdue = running = waiting = 0
    kv_total = 0.0
    for w in workers:
        if w.state is MemberState.READY:
            ready += 1
            kv_total += w.kv_usage
        elif w.state is MemberState.STARTING:
            if now_s - w.since_s > overdue_after_s:
                overdue += 1
            else:
                arriving += 1
        else:
            continue  # draining and failed workers are leaving: no capacity, no load
        running += w.running_requests
        waiting += w.waiting_requests
    kv_usage = kv_total / ready if ready else None
    return PoolSummary(ready, arriving, overdue, running, waiting, kv_usage)
