"""The local (Ray) actuator: a pool's size is its target in Redis, which `pdserve up` follows.

Writing a target is what `pdserve scale` does: the supervising loop of `pdserve up`
(cluster/supervise.py) starts workers or drains the ones whose cache is least held elsewhere
until the pool matches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pdserve.cluster.actuators import check_pool, check_scale
from pdserve.cluster.pool_control import PoolTargetStore
from pdserve.cluster.pool_manager import PoolTargets

log = logging.getLogger("pdserve.autoscale.ray")


class PoolTargetActuator:
    """An ``Actuator`` over the pool targets in Redis; ``fallback`` while none are stored."""

    def __init__(self, store: PoolTargetStore, fallback: PoolTargets) -> None:
        self._store = store
        self._targets = fallback

    def replicas(self, pool: str) -> int:
        self._targets = self._store.read(self._targets)
        return self._targets.of(check_pool(pool))

    def scale(self, pool: str, replicas: int, remove: Sequence[str] = ()) -> None:
        # ``remove`` is not needed: the pool drains by the same costs from its own members
        # (pool_manager.plan_scale, with the locality index's unique blocks and the load).
        current = self._store.read(self._targets)
        self._targets = self._store.set(check_scale(pool, replicas), replicas, current)
        log.info("%s pool target %d -> %d", pool, current.of(pool), replicas)
