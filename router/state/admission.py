"""Admission control and the router's own view of the work it has sent to each worker."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.proto.workers import WorkerLoad
from pdserve.router.edge.errors import OverloadedError
from pdserve.router.policies.types import RouteDecision


class ConcurrencyLimiter:
    """At most ``limit`` requests in flight; over it, fail fast with a retry hint.

    With ``adaptive``, the limit follows the service-level objective as TCP's window follows
    losses: it starts at ``floor``; each request that meets its objectives raises it by 1
    until the first miss (slow start: it doubles per round of requests), then by 1/limit
    (about one per ``limit`` such requests); one that misses lowers it to ``DECREASE`` times
    the requests then in flight, at most once per ``cooldown_s`` (the requests queued by one
    overload miss together, and one cut answers them all). It stays within [``floor``,
    ``ceiling``]. A burst above capacity thus meets a limit near what the workers serve in
    time, and the rest is refused at once instead of queued to miss its objective.

    As in TCP's congestion-window validation (RFC 7661), it grows only while in use: while
    ``GROWTH_ROOM`` times the most requests in flight since the previous met request reaches
    it. Otherwise a light load, every request met, would raise it to the ceiling, and a
    burst would be admitted whole for the seconds until the first miss is known (at the
    admitted requests' first tokens), every one of them queued past its objective.
    """

    DECREASE = 0.7
    GROWTH_ROOM = 2.0

    def __init__(
        self,
        ceiling: int,
        retry_after_s: int,
        floor: int = 1,
        cooldown_s: float = 1.0,
        adaptive: bool = False,
    ) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling, got {floor} and {ceiling}")
        self.ceiling = ceiling
        self.floor = floor
        self.retry_after_s = retry_after_s
        self.cooldown_s = cooldown_s
        self.adaptive = adaptive
        self.active = 0
        self._window = float(floor if adaptive else ceiling)
        self._slow_start_until = float(ceiling)  # TCP's ssthresh: the last cut, once cut
        self._next_cut_s = -math.inf
        self._peak = 0  # the most requests in flight since the last met request

    @property
    def limit(self) -> int:
        return int(self._window)

    def acquire(self) -> None:
        if self.active >= self.limit:
            raise OverloadedError(
                f"too many concurrent requests: {self.active} in flight, limit "
                f"{self.limit}; retry after {self.retry_after_s}s",
                self.retry_after_s,
            )
        self.active += 1
        self._peak = max(self._peak, self.active)

    def release(self) -> None:
        assert self.active > 0, "release() without a matching acquire()"
        self.active -= 1

    def met(self) -> None:
        """A request met its objectives."""
        if not self.adaptive:
            return
        if self.GROWTH_ROOM * self._peak >= self._window:
            step = 1.0 if self._window < self._slow_start_until else 1 / self._window
            self._window = min(self.ceiling, self._window + step)
        self._peak = self.active

    def missed(self, now_s: float) -> None:
        """A request missed an objective (known at its first token, or at its end)."""
        if not self.adaptive or now_s < self._next_cut_s:
            return
        self._window = max(self.floor, min(self._window, self.active) * self.DECREASE)
        self._slow_start_until = self._window
        self._next_cut_s = now_s + self.cooldown_s


@dataclass(slots=True, frozen=True)
class SloShedding:
    """Refuses at once a request that would queue far past its TTFT objective.

    When even the best place for a request has more work queued ahead of it than
    ``max_wait_s`` (the policy's prediction: the prefill tokens waiting there), it is refused
    with a retry hint of the excess: queueing it would make it miss its objective and slow
    every request behind it. A request that is merely long is not refused (its own prefill
    is not queueing). ``max_wait_s`` 0: off.
    """

    max_wait_s: float

    def check(self, ranked: Sequence[RouteDecision]) -> None:
        if self.max_wait_s <= 0 or not ranked:
            return
        best = min(d.queue_s for d in ranked)
        if best > self.max_wait_s:
            retry_after_s = max(1, math.ceil(best - self.max_wait_s))
            raise OverloadedError(
                f"overloaded: the least loaded place has {best:.1f} s of work queued, past "
                f"the {self.max_wait_s:.1f} s the router admits; retry after {retry_after_s}s",
                retry_after_s,
            )


@dataclass(slots=True)
class _Counts:
    prefilling: int = 0
    prefill_tokens: int = 0
    decoding: int = 0


class LocalLoadTracker:
    """Requests this router has in prefill / decode on each worker.

    Worker stats reach the directory with a delay (or never, for a static directory); the
    router's own counts fill the gap so that a burst does not all go to one worker.
    """

    def __init__(self) -> None:
        self._counts: defaultdict[str, _Counts] = defaultdict(_Counts)

    def start_prefill(self, worker_id: str, prompt_tokens: int) -> None:
        counts = self._counts[worker_id]
        counts.prefilling += 1
        counts.prefill_tokens += prompt_tokens

    def end_prefill(self, worker_id: str, prompt_tokens: int) -> None:
        counts = self._counts[worker_id]
        counts.prefilling -= 1
        counts.prefill_tokens -= prompt_tokens
        assert counts.prefilling >= 0, f"prefill count of {worker_id} went negative"

    def start_decode(self, worker_id: str) -> None:
        self._counts[worker_id].decoding += 1

    def end_decode(self, worker_id: str) -> None:
        counts = self._counts[worker_id]
        counts.decoding -= 1
        assert counts.decoding >= 0, f"decode count of {worker_id} went negative"

    def effective_load(self, worker_id: str, reported: WorkerLoad) -> WorkerLoad:
        """The larger of the reported and the locally known figures, field by field."""
        counts = self._counts.get(worker_id)
        if counts is None or not (counts.prefilling or counts.decoding or counts.prefill_tokens):
            return reported  # nothing of ours in flight there (the max would change nothing)
        return WorkerLoad(
            waiting=max(reported.waiting, counts.prefilling),
            running=max(reported.running, counts.decoding),
            free_blocks=reported.free_blocks,
            queued_prefill_tokens=max(reported.queued_prefill_tokens, counts.prefill_tokens),
        )
