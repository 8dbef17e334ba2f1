"""Actuators: how the autoscaler's decisions become pool sizes, one per platform.

An actuator sets the replica count of a pool, ``"prefill"`` or ``"decode"``: ``replicas(pool)``
is the pool's current desired count, ``scale(pool, n, remove)`` sets it, removing first the
workers the planner named (``PoolDecision.drain_first``) where the platform lets it choose.
The planner (``pdserve.cluster.autoscale``) decides; an actuator only acts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

POOLS: tuple[str, ...] = ("prefill", "decode")


@runtime_checkable
class Actuator(Protocol):
    """Sets the replica count of a pool (``"prefill"`` or ``"decode"``)."""

    def replicas(self, pool: str) -> int:
        """The pool's current desired replica count."""
        ...

    def scale(self, pool: str, replicas: int, remove: Sequence[str] = ()) -> None:
        """Set the pool's replica count to ``replicas`` (>= 0). On scale-in, ``remove`` names
        the workers to remove, cheapest first; an actuator whose platform picks by the same
        costs itself (the Ray pools) or picks nothing (metrics only) may ignore it."""
        ...


class WorkerDrain(Protocol):
    """Takes workers out of routing and waits for their running requests, before an actuator
    removes them (``cluster/worker_drain.py`` over the Redis registry)."""

    def drain(self, worker_ids: Sequence[str]) -> Mapping[str, int]:
        """Stop routing to ``worker_ids`` and wait, bounded, until they are idle; returns the
        requests each still had when the wait ended (0: drained)."""
        ...

    def release(self, worker_ids: Sequence[str]) -> None:
        """Route to them again: their removal did not happen."""
        ...


class MetricsOnlyActuator:
    """Acts on nothing: remembers the desired counts, which the planner's metrics export
    (``pdserve_planner_desired_replicas``) for an HPA or KEDA to act on."""

    def __init__(self, initial: int = 1) -> None:
        self._replicas = dict.fromkeys(POOLS, initial)

    def replicas(self, pool: str) -> int:
        return self._replicas[check_pool(pool)]

    def scale(self, pool: str, replicas: int, remove: Sequence[str] = ()) -> None:
        self._replicas[check_scale(pool, replicas)] = replicas


def check_pool(pool: str) -> str:
    """``pool`` if it is one of :data:`POOLS`, else ValueError."""
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {list(POOLS)}, got {pool!r}")
    return pool


def check_scale(pool: str, replicas: int) -> str:
    """``pool`` if it is one of :data:`POOLS` and ``replicas`` >= 0, else ValueError."""
    check_pool(pool)
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas} for the {pool} pool")
    return pool
