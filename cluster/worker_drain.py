"""Draining workers through the Redis registry, for an actuator that removes them from
outside their process (the Kubernetes actuator, before it lowers a Deployment's replicas).

``RegistryDrain.drain`` marks each worker as draining (``WorkerRegistry.cordon``): the
routers' next directory refresh (0.25 s) leaves it out, while its heartbeats keep reporting
its load. It then waits until every drained worker reports no running or waiting request,
bounded by ``timeout_s`` (``PDSERVE_DRAIN_TIMEOUT_S``), as the Ray pools wait for theirs.
The mark expires ``hold_s`` after the wait at the latest, so a removal that never comes (the
planner died, the API server refused) gives the worker back to the routers by itself;
``release`` gives it back at once. The pod's own drain on SIGTERM (``pdserve worker``) then
finds it idle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.cluster.pool_manager import drain_finished
from pdserve.cluster.registry import WorkerRegistry

log = logging.getLogger("pdserve.autoscale.drain")


@dataclass(slots=True, frozen=True)
class DrainConfig:
    """``settle_s``: wait at least this long before trusting an idle report, so that a
    heartbeat sent after the routers stopped routing there has arrived (heartbeat period +
    the routers' 0.25 s refresh). ``hold_s``: how long the mark outlives the wait, time
    enough for the removal to follow."""

    timeout_s: float = 30.0
    settle_s: float = 1.5
    poll_s: float = 0.5
    hold_s: float = 60.0

    def __post_init__(self) -> None:
        times = (self.timeout_s, self.settle_s, self.poll_s, self.hold_s)
        if min(times) < 0 or self.poll_s <= 0 or self.hold_s < 1:
            raise ValueError(
                "need timeout_s, settle_s >= 0, poll_s > 0 and hold_s >= 1, got (timeout_s, "
                f"settle_s, poll_s, hold_s)={times}"
            )


class RegistryDrain:
    """A ``pdserve.cluster.actuators.WorkerDrain`` over the Redis registry."""

    def __init__(
        self,
        registry: WorkerRegistry,
        config: DrainConfig,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._registry = registry
        self._config = config
        self._clock = clock
        self._sleep = sleep

    def drain(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Requests each worker still had when the wait ended; a worker that is not
        registered (gone, or never started) has nothing to drain: 0."""
        c = self._config
        ttl_s = c.settle_s + c.timeout_s + c.hold_s
        drained = [w for w in worker_ids if self._registry.cordon(w, ttl_s)]
        left = dict.fromkeys(worker_ids, 0)
        if not drained:
            return left
        start_s = self._clock()
        self._sleep(c.settle_s)
        while True:
            left |= {w: self._busy(w) for w in drained}
            waited_s = self._clock() - start_s
            if all(drain_finished(left[w], waited_s, c.timeout_s) for w in drained):
                break
            self._sleep(c.poll_s)
        busy = {w: n for w, n in left.items() if n}
        if busy:
            log.warning("drain timed out after %.0f s with requests left: %s", waited_s, busy)
        else:
            log.info("drained %s in %.1f s", drained, waited_s)
        return left

    def release(self, worker_ids: Sequence[str]) -> None:
        for worker_id in worker_ids:
            self._registry.uncordon(worker_id)

    def _busy(self, worker_id: str) -> int:
        info = self._registry.get(worker_id)
        return 0 if info is None else info.load.running + info.load.waiting
