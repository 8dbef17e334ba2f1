"""Routing policies: pure functions of plain dataclasses (no grpc, asyncio or I/O).

``make_policy(name)`` builds one by name: ``round_robin``, ``least_loaded``,
``prefix_aware`` or ``joint_ttft`` (the default).
"""

from __future__ import annotations

from pdserve.router.policies.cost import predict_ttft, split_pools
from pdserve.router.policies.joint import JointTtftPolicy
from pdserve.router.policies.prefix_aware import PrefixAwarePolicy
from pdserve.router.policies.simple import LeastLoadedPolicy, RoundRobinPolicy
from pdserve.router.policies.types import (
    CostModel,
    PeerFetch,
    PrefixHit,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerCandidate,
)

DEFAULT_POLICY = JointTtftPolicy.name
POLICY_NAMES = (
    RoundRobinPolicy.name,
    LeastLoadedPolicy.name,
    PrefixAwarePolicy.name,
    JointTtftPolicy.name,
)


def normalize_policy_name(name: str) -> str:
    """'Least-Loaded' -> 'least_loaded'; raises ValueError for an unknown name."""
    key = name.strip().lower().replace("-", "_")
    if key not in POLICY_NAMES:
        raise ValueError(f"routing_policy must be one of {list(POLICY_NAMES)}, got {name!r}")
    return key


def make_policy(
    name: str, cost: CostModel | None = None, load_margin: int = 4, peer_fetch: bool = True
) -> RoutingPolicy:
    """Build the policy called ``name`` (see ``POLICY_NAMES``); ``peer_fetch``: whether
    ``joint_ttft`` may choose peer fetches."""
    key = normalize_policy_name(name)
    if key == RoundRobinPolicy.name:
        return RoundRobinPolicy(cost)
    if key == LeastLoadedPolicy.name:
        return LeastLoadedPolicy(cost)
    if key == PrefixAwarePolicy.name:
        return PrefixAwarePolicy(cost, load_margin)
    return JointTtftPolicy(cost, peer_fetch=peer_fetch)


__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "CostModel",
    "JointTtftPolicy",
    "LeastLoadedPolicy",
    "PeerFetch",
    "PrefixAwarePolicy",
    "PrefixHit",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "WorkerCandidate",
    "make_policy",
    "normalize_policy_name",
    "predict_ttft",
    "split_pools",
]
