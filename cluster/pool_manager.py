"""Pool management policy (pure: no Ray, no Redis): which workers to start, drain, replace.

A pool is the set of workers of one role. Each worker has a stable id ``<role>-<slot>``;
its Ray actor may be restarted by Ray (same id, new epoch), or be lost for good once Ray
gives up (then the manager starts a replacement in the same slot). :func:`plan_scale`
compares the members with the target size and returns a :class:`ScaleDecision`;
cluster/ray_pools.py carries it out::

    members: prefill-0 READY, prefill-1 FAILED, prefill-2 STARTING      target 2
    -> start (prefill-1,)  drain (prefill-2,)     (fill the failed slot; drop the surplus,
                                                   preferring one that serves nothing yet)

Scale-up: new workers load and warm up before they register, so the router only sees them
once they can serve. Scale-down drains: deregister, wait for running requests, stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class MemberState(StrEnum):
    STARTING = "starting"  # actor created, model loading; not registered yet
    READY = "ready"  # registered, serving
    DRAINING = "draining"  # deregistered, finishing its running requests
    FAILED = "failed"  # gone for good (Ray restarts exhausted): its slot needs a new worker


@dataclass(slots=True, frozen=True)
class PoolMember:
    """``since_s``: when it entered ``state`` (monotonic clock). ``unique_blocks``: cached
    blocks no other worker of the pool holds (the locality index): lost if it is removed."""

    worker_id: str
    slot: int
    state: MemberState
    running_requests: int = 0
    since_s: float = 0.0
    unique_blocks: int = 0


@dataclass(slots=True, frozen=True)
class ScaleDecision:
    """Worker ids to start (new or replacing a failed one) and to drain, in that order."""

    start: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()

    @property
    def is_noop(self) -> bool:
        return not self.start and not self.drain


def worker_id_for(role: str, slot: int) -> str:
    if slot < 0:
        raise ValueError(f"slot must be >= 0, got {slot}")
    return f"{role}-{slot}"


def plan_scale(pool: str, members: Sequence[PoolMember], target: int) -> ScaleDecision:
    """What to do to bring ``pool`` to ``target`` serving-or-starting workers. New worker
    ids are ``<pool>-<slot>``: ``pool`` is the role, or the role and a host's name."""
    if target < 0:
        raise ValueError(f"target size of the {pool} pool must be >= 0, got {target}")
    active = [m for m in members if m.state in (MemberState.STARTING, MemberState.READY)]
    if len(active) > target:
        return ScaleDecision(
            drain=tuple(m.worker_id for m in _drain_order(active)[: len(active) - target])
        )
    missing = target - len(active)
    return ScaleDecision(start=tuple(worker_id_for(pool, s) for s in _free_slots(members, missing)))


def _drain_order(active: Sequence[PoolMember]) -> list[PoolMember]:
    # Cheapest to lose first: not serving yet, then the cache least held elsewhere, then the
    # least busy, then the newest slot.
    def cost(m: PoolMember) -> tuple[int, int, int, int]:
        return (m.state is MemberState.READY, m.unique_blocks, m.running_requests, -m.slot)

    return sorted(active, key=cost)


def _free_slots(members: Sequence[PoolMember], count: int) -> list[int]:
    """Failed slots first (their worker ids come back with a new epoch), then new ones."""
    taken = {m.slot for m in members if m.state is not MemberState.FAILED}
    failed = sorted(m.slot for m in members if m.state is MemberState.FAILED)
    slots = [s for s in failed if s not in taken][:count]
    candidate = 0
    while len(slots) < count:
        if candidate not in taken and candidate not in slots:
            slots.append(candidate)
        candidate += 1
    return slots


def drain_finished(running_requests: int, waited_s: float, timeout_s: float) -> bool:
    """A draining worker may stop once idle, or when the drain timeout ran out."""
    return running_requests == 0 or waited_s >= timeout_s


@dataclass(slots=True, frozen=True)
class PoolTargets:
    """Target sizes of the three pools, as ``pdserve up`` was asked (or rescaled)."""

    prefill: int = 1
    decode: int = 1
    colocated: int = 0

    def __post_init__(self) -> None:
        sizes = (self.prefill, self.decode, self.colocated)
        if min(sizes) < 0:
            raise ValueError(f"pool sizes must be >= 0, got (prefill, decode, colocated)={sizes}")

    def check_serves(self) -> PoolTargets:
        """These pools, if they can serve requests by themselves; else ValueError. (The
        pools of a head need not: the hosts that join bring the other workers.)"""
        if self.prefill + self.colocated == 0:
            raise ValueError(
                "no worker can run a prompt: ask for --prefill >= 1 (with --decode >= 1) or "
                "--colocated >= 1"
            )
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError(
                "disaggregated serving needs both pools: got --prefill "
                f"{self.prefill} and --decode {self.decode}; give both >= 1, or use "
                "--colocated alone"
            )
        return self

    def of(self, role: str) -> int:
        sizes = {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}
        if role not in sizes:
            raise ValueError(f"role must be one of {sorted(sizes)}, got {role!r}")
        return sizes[role]
