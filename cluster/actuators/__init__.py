"""Actuators: how the autoscaler's decisions become pool sizes, one per platform.

An actuator sets the replica count of a pool, ``"prefill"`` or ``"decode"``: ``replicas(pool)``
is the pool's current desired count, ``scale(pool, n)`` sets it. The planner
(``pdserve.cluster.autoscale``) decides; an actuator only acts.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

POOLS: tuple[str, ...] = ("prefill", "decode")


@runtime_checkable
class Actuator(Protocol):
    """Sets the replica count of a pool (``"prefill"`` or ``"decode"``)."""

    def replicas(self, pool: str) -> int:
        """The pool's current desired replica count."""
        ...

    def scale(self, pool: str, replicas: int) -> None:
        """Set the pool's replica count to ``replicas`` (>= 0)."""
        ...


class MetricsOnlyActuator:
    """Acts on nothing: remembers the desired counts, which the planner's metrics export
    (``pdserve_planner_desired_replicas``) for an HPA or KEDA to act on."""

    def __init__(self, initial: int = 1) -> None:
        self._replicas = dict.fromkeys(POOLS, initial)

    def replicas(self, pool: str) -> int:
        return self._replicas[check_pool(pool)]

    def scale(self, pool: str, replicas: int) -> None:
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
