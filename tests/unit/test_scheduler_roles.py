"""n > 1 forking with copy-on-write, prefill-role hold_kv/release, decode-role imports."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import (
    BatchPlan,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    SequenceUpdate,
)

PROMPT = [10, 11, 12, 13, 14, 15]


def make(num_blocks: int = 16, max_seqs: int = 4) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, extra_keys=("model:test",))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=max_seqs), kv)


def seq(seq_id: str, prompt: list[int] = PROMPT, max_tokens: int = 16, **kw: object) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, n=1)
    return Sequence(seq_id, prompt, params, **kw)  # type: ignore[arg-type]


def group(n: int, max_tokens: int = 16) -> list[Sequence]:
    return [seq(f"r#{i}", max_tokens=max_tokens) for i in range(n)]


def shape(plan: BatchPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.seq_id, c.start_pos, c.num_tokens, c.sample) for c in plan.chunks]


def step(sched: Scheduler, tokens: Mapping[str, int] | None = None) -> BatchPlan:
    plan = sched.schedule()
    sched.update(plan, {c.seq_id: (tokens or {}).get(c.seq_id, 7) for c in plan.chunks if c.sample})
    return plan


def test_siblings_fork_from_the_leader_and_copy_the_shared_partial_block() -> None:
    sched = make()
    sched.add_group(group(3))
    p1 = step(sched, {"r#0": 100})
    assert shape(p1) == [("r#0", 0, 6, True)]
    assert sched.num_running == 3 and sched.num_waiting == 0
    assert sched.kv.block_table("r#2") == (0, 1)
    p2 = step(sched, {"r#0": 101, "r#1": 200, "r#2": 300})
    # Each sibling recomputes the last prompt token to sample its own first token.
    assert shape(p2) == [("r#0", 6, 1, True), ("r#1", 5, 1, True), ("r#2", 5, 1, True)]
    assert [c.token_ids for c in p2.chunks] == [(100,), (15,), (15,)]
    # Block 1 (positions 4..7) is shared three ways: the first two writers copy it.
    assert [c.block_table for c in p2.chunks] == [(0, 2), (0, 3), (0, 1)]
    assert p2.block_copies == ((1, 2), (1, 3))
    p3 = step(sched)
    assert shape(p3) == [("r#0", 7, 1, True), ("r#1", 6, 1, True), ("r#2", 6, 1, True)]
    assert p3.block_copies == ()
    outputs = [s.output_token_ids for s in (sched.get(f"r#{i}") for i in range(3)) if s]
    assert outputs == [[100, 101, 7], [200, 7], [300, 7]]


def test_siblings_fork_even_when_the_leader_finishes_at_once() -> None:
    sched = make()
    sched.add_group(group(2, max_tokens=1))
    step(sched)
    p2 = step(sched)
    assert shape(p2) == [("r#1", 5, 1, True)]
    assert p2.block_copies == ()  # the leader freed its blocks: block 1 is not shared now
    assert not sched.has_unfinished()
    assert sched.kv.num_free_blocks == 16


def test_aborting_a_leader_before_the_fork_promotes_a_sibling() -> None:
    sched = make()
    sched.add_group(group(3))
    assert sched.abort("r#0") is True
    assert shape(step(sched)) == [("r#1", 0, 6, True)]
    assert sched.num_running == 2  # r#2 forked from the new leader


def test_a_group_reserves_its_sequence_slots() -> None:
    sched = make(max_seqs=3)
    sched.add_group(group(3))
    sched.add(seq("x", [1, 2, 3]))
    assert shape(step(sched)) == [("r#0", 0, 6, True)]
    assert [c.seq_id for c in step(sched).chunks] == ["r#0", "r#1", "r#2"]
    with pytest.raises(ValueError, match="max_num_seqs=3"):
        sched.add_group([seq(f"big#{i}") for i in range(4)])


def test_hold_kv_keeps_blocks_after_finishing_until_released() -> None:
    sched = make()
    sched.add(seq("p", max_tokens=1, hold_kv=True))
    plan = sched.schedule()
    assert sched.update(plan, {"p": 42}) == [SequenceUpdate("p", (42,), True, "length")]
    assert not sched.has_unfinished()
    assert sched.num_held == 1
    assert sched.kv.block_table("p") == (0, 1)
    assert sched.kv.num_free_blocks == 14
    held = sched.get("p")
    assert held is not None and held.status is SequenceStatus.FINISHED_LENGTH
    assert sched.release("p") is True
    assert sched.release("p") is False
    assert sched.kv.num_free_blocks == 16


def test_aborting_a_held_sequence_releases_its_blocks() -> None:
    sched = make()
    sched.add(seq("p", max_tokens=1, hold_kv=True))
    step(sched)
    assert sched.abort("p") is True
    assert sched.num_held == 0 and sched.kv.num_free_blocks == 16


def test_imported_sequence_decodes_from_its_reserved_blocks() -> None:
    sched = make(max_seqs=1)
    reservation = sched.kv.reserve_for_import("d", PROMPT)
    assert reservation is not None and reservation.block_ids == (0, 1)
    imported = seq("d", output_token_ids=[42])
    assert sched.admit_imported(imported) is True
    assert imported.num_computed_tokens == 6 and imported.status is SequenceStatus.RUNNING
    plan = step(sched)
    assert shape(plan) == [("d", 6, 1, True)]
    assert plan.chunks[0].token_ids == (42,)
    assert plan.chunks[0].block_table == (0, 1)
    assert imported.output_token_ids == [42, 7]
    # The imported full block is now in the prefix cache.
    assert sched.kv.lookup_prefix([*PROMPT[:4], 0]).block_ids == (0,)
    assert sched.kv.reserve_for_import("e", PROMPT) is not None
    assert sched.admit_imported(seq("e", output_token_ids=[1])) is False  # no seq slot
    with pytest.raises(ValueError, match="reserve_for_import first"):
        sched.admit_imported(seq("f", output_token_ids=[1]))
