"""Pinning worker processes to CPU cores (``PDSERVE_CPU_AFFINITY`` / ``pdserve up --cpu-affinity``).

The spec names cores per pool: ``"prefill=0;decode=1;colocated=0,1"``. Worker slot ``i`` of a
pool (worker id ``<role>-<i>``) is pinned to ``cores[i % len(cores)]``, one core per worker,
so ``colocated=0,1`` puts two colocated workers on one core each. Pools not named are not
pinned. Pinning covers every thread the worker process has when it starts (Ray's included)
and, by inheritance, every thread it starts later (the engine thread, torch's pool).
Used to measure disaggregation side by side on a small machine (bench/no_stall.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("pdserve.cpu_affinity")

POOL_ROLES = ("prefill", "decode", "colocated")
CpuAffinity = tuple[tuple[str, tuple[int, ...]], ...]  # ((role, cores), ...), roles unique


def parse_cpu_affinity(spec: str) -> CpuAffinity:
    """``"prefill=0;decode=1;colocated=0,1"`` -> ``(("prefill", (0,)), ("decode", (1,)),
    ("colocated", (0, 1)))``; ``""`` -> ``()`` (nothing pinned). ValueError names the bad part."""
    pools: dict[str, tuple[int, ...]] = {}
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        role, sep, cores_text = (s.strip() for s in part.partition("="))
        if not sep or role not in POOL_ROLES:
            raise ValueError(
                f"cpu affinity {part!r}: expected ROLE=CORES with ROLE one of {POOL_ROLES}, "
                "e.g. 'prefill=0;decode=1;colocated=0,1'"
            )
        if role in pools:
            raise ValueError(f"cpu affinity {spec!r} names the {role} pool twice")
        pools[role] = _parse_cores(part, cores_text)
    return tuple(pools.items())


def _parse_cores(part: str, text: str) -> tuple[int, ...]:
    try:
        cores = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise ValueError(
            f"cpu affinity {part!r}: cores must be comma-separated integers, got {text!r}"
        ) from None
    if any(c < 0 for c in cores):
        raise ValueError(f"cpu affinity {part!r}: core numbers must be >= 0")
    return cores


def core_for_worker(affinity: CpuAffinity, role: str, worker_id: str) -> int | None:
    """The core worker ``<role>-<slot>`` is pinned to, or None when its pool is not pinned.
    A worker id without a numeric slot counts as slot 0."""
    cores = dict(affinity).get(role)
    if not cores:
        return None
    _, _, tail = worker_id.rpartition("-")
    slot = int(tail) if tail.isdigit() else 0
    return cores[slot % len(cores)]


def pin_process(core: int) -> None:
    """Pin every thread of this process to ``core`` (Linux: affinity is per thread, and a
    new thread inherits its creator's). ValueError when the core is not available here."""
    allowed = os.sched_getaffinity(0)
    if core not in allowed:
        raise ValueError(
            f"cannot pin to CPU core {core}: this process may use cores {sorted(allowed)}"
        )
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {core})
        except ProcessLookupError:
            continue  # the thread ended meanwhile
    log.info("pid %d pinned to CPU core %d", os.getpid(), core)
