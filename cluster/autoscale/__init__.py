"""Autoscaling policy (pure: stdlib only, no I/O, no clock of its own).

Every interval :class:`Planner` turns the observed load, a measured
:class:`CapacityProfile` and each pool's workers into a target size per pool
(:class:`PlannerDecision`), each with its reason in words. The modules:

* ``observations``: what a decision reads (:class:`LoadSample`, :class:`WorkerObservation`,
  :class:`PoolObservation`, :class:`ClusterObservation`);
* ``profile``: per-worker capacity (:class:`CapacityProfile`, :class:`DecodePoint`);
* ``forecast``: Holt's linear trend (:class:`HoltForecaster`, :class:`LoadForecaster`);
* ``sizing``: load -> tokens/s -> replicas, with the latency correction;
* ``pool_policy``: one pool's decision (bounds, steps, cooldowns, hysteresis, cold starts);
* ``victims``: which workers to remove on scale-in;
* ``planner``: the :class:`Planner` tying them together.

Carrying a decision out is an actuator's job (the pool targets that ``plan_scale`` follows,
as for ``pdserve scale``, or an orchestrator's replica count); actuators live in their own
modules, which this package's ``__init__`` does not import.
"""

from __future__ import annotations

from pdserve.cluster.autoscale.config import PlannerConfig, PoolLimits
from pdserve.cluster.autoscale.forecast import HoltForecaster, LoadForecaster
from pdserve.cluster.autoscale.observations import (
    ClusterObservation,
    LoadSample,
    PoolObservation,
    PoolSummary,
    WorkerObservation,
    summarize,
)
from pdserve.cluster.autoscale.planner import Planner, PlannerDecision
from pdserve.cluster.autoscale.pool_policy import PoolDecision, PoolMemory
from pdserve.cluster.autoscale.profile import CapacityProfile, DecodePoint, max_batch_within_itl
from pdserve.cluster.autoscale.sizing import PoolDemand, latency_correction, replicas_for
from pdserve.cluster.autoscale.victims import choose_victims, removal_cost

__all__ = [
    "CapacityProfile",
    "ClusterObservation",
    "DecodePoint",
    "HoltForecaster",
    "LoadForecaster",
    "LoadSample",
    "Planner",
    "PlannerConfig",
    "PlannerDecision",
    "PoolDecision",
    "PoolDemand",
    "PoolLimits",
    "PoolMemory",
    "PoolObservation",
    "PoolSummary",
    "WorkerObservation",
    "choose_victims",
    "latency_correction",
    "max_batch_within_itl",
    "removal_cost",
    "replicas_for",
    "summarize",
]
