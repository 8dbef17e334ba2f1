"""Worker CPU pinning (cluster/cpu_affinity.py): the spec, slot -> core, pinning every thread."""

from __future__ import annotations

import os
import threading

import pytest

from pdserve.cluster import cpu_affinity
from pdserve.cluster.cpu_affinity import core_for_worker, parse_cpu_affinity, pin_process
from pdserve.cluster.settings import Settings


def test_parse_spec_per_pool() -> None:
    spec = parse_cpu_affinity(" prefill=0; decode = 1 ;colocated=0,1;")
    assert spec == (("prefill", (0,)), ("decode", (1,)), ("colocated", (0, 1)))
    assert parse_cpu_affinity("") == ()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("prefill:0", "expected ROLE=CORES"),
        ("router=0", "expected ROLE=CORES"),
        ("decode=a", "comma-separated integers"),
        ("decode=", "comma-separated integers"),
        ("decode=-1", ">= 0"),
        ("decode=0;decode=1", "names the decode pool twice"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cpu_affinity(spec)


def test_worker_slots_take_the_listed_cores_in_turn() -> None:
    spec = parse_cpu_affinity("colocated=2,3;prefill=0")
    cores = [core_for_worker(spec, "colocated", f"colocated-{slot}") for slot in range(4)]
    assert cores == [2, 3, 2, 3]
    assert core_for_worker(spec, "prefill", "prefill-7") == 0
    assert core_for_worker(spec, "decode", "decode-0") is None  # pool not named: not pinned
    assert core_for_worker(spec, "colocated", "my-worker") == 2  # no numeric slot: slot 0
    assert core_for_worker((), "prefill", "prefill-0") is None


def test_settings_read_the_variable_and_name_it_when_bad() -> None:
    settings = Settings.from_env({"PDSERVE_CPU_AFFINITY": "prefill=0;decode=1"})
    assert settings.cpu_affinity == (("prefill", (0,)), ("decode", (1,)))
    assert Settings.from_env({}).cpu_affinity == ()
    with pytest.raises(ValueError, match="PDSERVE_CPU_AFFINITY"):
        Settings.from_env({"PDSERVE_CPU_AFFINITY": "prefill=x"})


def test_pin_process_pins_every_existing_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[int, set[int]] = {}
    monkeypatch.setattr(cpu_affinity.os, "sched_setaffinity", lambda tid, c: calls.update({tid: c}))
    core = min(os.sched_getaffinity(0))
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        pin_process(core)
    finally:
        stop.set()
        thread.join()
    assert thread.native_id in calls and threading.get_native_id() in calls
    assert set(map(frozenset, calls.values())) == {frozenset({core})}


def test_pin_process_refuses_a_core_this_process_may_not_use() -> None:
    unavailable = max(os.sched_getaffinity(0)) + 1
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=f"cannot pin to CPU core {unavailable}"):
        pin_process(unavailable)
    assert os.sched_getaffinity(0) == before
