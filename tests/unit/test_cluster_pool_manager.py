"""Pool management policy: exact start/drain decisions on tiny pools, and settings parsing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster.pool_manager import (
    MemberState,
    PoolMember,
    PoolTargets,
    ScaleDecision,
    drain_finished,
    plan_scale,
)
from pdserve.cluster.settings import Settings

S, R, D, F = MemberState.STARTING, MemberState.READY, MemberState.DRAINING, MemberState.FAILED


def m(slot: int, state: MemberState, running: int = 0, unique: int = 0) -> PoolMember:
    return PoolMember(f"prefill-{slot}", slot, state, running, unique_blocks=unique)


def test_empty_pool_starts_slots_from_zero() -> None:
    assert plan_scale("prefill", [], 3) == ScaleDecision(
        start=("prefill-0", "prefill-1", "prefill-2")
    )


def test_at_target_is_a_noop_and_draining_members_do_not_count() -> None:
    assert plan_scale("prefill", [m(0, R), m(1, S)], 2).is_noop
    # slot 1 is draining: one more worker is needed, and it must not reuse slot 1
    assert plan_scale("prefill", [m(0, R), m(1, D)], 2) == ScaleDecision(start=("prefill-2",))


def test_failed_slot_is_refilled_first() -> None:
    members = [m(0, R), m(1, F), m(2, R)]
    assert plan_scale("prefill", members, 3) == ScaleDecision(start=("prefill-1",))
    assert plan_scale("prefill", members, 4) == ScaleDecision(start=("prefill-1", "prefill-3"))


def test_scale_down_drains_starting_then_least_busy_then_newest() -> None:
    members = [m(0, R, running=5), m(1, R, running=0), m(2, S), m(3, R, running=0)]
    assert plan_scale("prefill", members, 3) == ScaleDecision(drain=("prefill-2",))
    assert plan_scale("prefill", members, 2) == ScaleDecision(drain=("prefill-2", "prefill-3"))
    assert plan_scale("prefill", members, 0).drain == (
        "prefill-2",
        "prefill-3",
        "prefill-1",
        "prefill-0",
    )


def test_scale_down_keeps_the_cache_that_only_one_worker_holds() -> None:
    # prefill-0 is idle but alone holds 40 cached blocks; prefill-1 is busier, holds none
    # that others lack: losing prefill-1 costs its running requests' drain, not recomputation.
    members = [m(0, R, running=0, unique=40), m(1, R, running=2, unique=0), m(2, R, unique=3)]
    assert plan_scale("prefill", members, 2) == ScaleDecision(drain=("prefill-1",))
    assert plan_scale("prefill", members, 1) == ScaleDecision(drain=("prefill-1", "prefill-2"))


def test_bad_targets_are_rejected_with_actionable_messages() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        plan_scale("prefill", [], -1)
    with pytest.raises(ValueError, match=">= 0"):
        PoolTargets(prefill=-1)
    with pytest.raises(ValueError, match="both pools"):
        PoolTargets(prefill=1, decode=0).check_serves()
    with pytest.raises(ValueError, match="no worker can run a prompt"):
        PoolTargets(prefill=0, decode=0, colocated=0).check_serves()
    colocated = PoolTargets(prefill=0, decode=0, colocated=2)
    assert colocated.check_serves() is colocated
    # a head's own pools may be anything: the hosts that join bring the rest
    assert PoolTargets(prefill=0, decode=1).of("decode") == 1


def test_drain_finishes_when_idle_or_out_of_time() -> None:
    assert drain_finished(0, 0.0, 30.0)
    assert not drain_finished(2, 5.0, 30.0)
    assert drain_finished(2, 30.0, 30.0)


def test_settings_parse_types_and_name_the_bad_variable() -> None:
    s = Settings.from_env({"PDSERVE_LEASE_S": "8", "PDSERVE_MAX_RESTARTS": "-1", "X": "y"})
    assert s.lease_s == 8.0 and s.max_restarts == -1 and s.redis_url is None
    with pytest.raises(ValueError, match="PDSERVE_LEASE_S='soon'"):
        Settings.from_env({"PDSERVE_LEASE_S": "soon"})
    with pytest.raises(ValueError, match="HEARTBEAT_S"):
        Settings.from_env({"PDSERVE_HEARTBEAT_S": "9"})


def test_pool_policy_imports_without_ray_redis_or_torch() -> None:
    probe = (
        "import sys\n"
        "for name in ('torch', 'ray', 'redis', 'grpc'): sys.modules[name] = None\n"
        "import pdserve.cluster.pool_manager, pdserve.cluster.settings\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
