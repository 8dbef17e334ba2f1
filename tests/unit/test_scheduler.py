"""Scheduler batching: decode-first steps, chunked prefill under a budget, stops, validation."""

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


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 16,
    max_seqs: int = 4,
    chunked: bool = True,
    threshold: int | None = None,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, extra_keys=("model:test",))
    config = SchedulerConfig(budget, max_seqs, chunked, threshold)
    return Scheduler(config, kv)


def seq(seq_id: str, prompt_len: int, first: int = 0, **params: object) -> Sequence:
    sampling = SamplingParams(**{"max_tokens": 16, "temperature": 0.0, **params})  # type: ignore[arg-type]
    return Sequence(seq_id, list(range(first, first + prompt_len)), sampling, eos_token_id=2)


def shape(plan: BatchPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.seq_id, c.start_pos, c.num_tokens, c.sample) for c in plan.chunks]


def step(sched: Scheduler, tokens: Mapping[str, int] | None = None) -> BatchPlan:
    plan = sched.schedule()
    sched.update(plan, {c.seq_id: (tokens or {}).get(c.seq_id, 7) for c in plan.chunks if c.sample})
    return plan


def test_budget_16_chunks_a_40_token_prompt_then_decodes_first() -> None:
    sched = make()
    sched.add(seq("A", 40))
    sched.add(seq("B", 10, first=1000))
    p1 = step(sched)
    assert shape(p1) == [("A", 0, 16, False)]
    assert p1.chunks[0].block_table == (0, 1, 2, 3)
    assert p1.chunks[0].token_ids == tuple(range(16))
    assert shape(step(sched)) == [("A", 16, 16, False)]
    p3 = step(sched, {"A": 500})
    assert shape(p3) == [("A", 32, 8, True), ("B", 0, 8, False)]
    assert p3.chunks[0].block_table == tuple(range(10))
    assert p3.chunks[1].block_table == (10, 11)
    p4 = step(sched, {"A": 501, "B": 600})
    assert shape(p4) == [("A", 40, 1, True), ("B", 8, 2, True)]
    assert p4.chunks[0].token_ids == (500,)
    assert p4.chunks[0].block_table == (*range(10), 12)  # A's decode is allocated first
    assert p4.chunks[1].block_table == (10, 11, 13)
    assert p4.chunks[1].token_ids == (1008, 1009)
    p5 = step(sched)
    assert shape(p5) == [("A", 41, 1, True), ("B", 10, 1, True)]
    assert p5.chunks[1].token_ids == (600,)
    assert all(p.num_batched_tokens <= 16 for p in (p1, p3, p4, p5))


def test_long_prefill_threshold_caps_each_chunk() -> None:
    sched = make(threshold=6)
    sched.add(seq("A", 10))
    sched.add(seq("B", 10, first=1000))
    assert shape(step(sched)) == [("A", 0, 6, False), ("B", 0, 6, False)]
    assert shape(step(sched)) == [("A", 6, 4, True), ("B", 6, 4, True)]


def test_without_chunking_a_prompt_that_does_not_fit_waits() -> None:
    sched = make(chunked=False)
    sched.add(seq("A", 10))
    sched.add(seq("B", 10, first=1000))
    sched.add(seq("C", 3, first=2000))
    assert shape(step(sched)) == [("A", 0, 10, True)]  # B (10) > 6 left; C must not overtake
    assert shape(step(sched)) == [("A", 10, 1, True), ("B", 0, 10, True), ("C", 0, 3, True)]


def test_without_chunking_an_oversized_prompt_gets_a_step_of_its_own() -> None:
    sched = make(chunked=False)
    sched.add(seq("A", 4))
    step(sched)
    sched.add(seq("L", 40, first=1000))
    plan = step(sched)
    assert shape(plan) == [("L", 0, 40, True)]  # A's decode waits one step
    assert plan.chunks[0].block_table == tuple(range(1, 11))
    assert shape(step(sched)) == [("A", 4, 1, True), ("L", 40, 1, True)]


def test_prefix_cache_hit_skips_computation() -> None:
    sched = make()
    sched.add(seq("A", 10, max_tokens=1))
    step(sched)  # A finishes; its two full prompt blocks stay cached
    sched.add(seq("B", 10))
    plan = step(sched)
    assert shape(plan) == [("B", 8, 2, True)]
    assert plan.chunks[0].block_table[:2] == (0, 1)
    b = sched.get("B")
    assert b is not None and b.num_cached_tokens == 8
    stats = sched.stats()
    assert (stats.prefix_hit_tokens, stats.prefix_queried_tokens) == (8, 20)


def test_stop_conditions() -> None:
    sched = make()
    sched.add(seq("eos", 3))
    sched.add(seq("stop_id", 3, first=100, stop_token_ids=(55,)))
    sched.add(seq("ignore", 3, first=200, ignore_eos=True, max_tokens=2))
    updates = sched.update(sched.schedule(), {"eos": 2, "stop_id": 55, "ignore": 2})
    assert updates == [
        SequenceUpdate("eos", (2,), True, "stop"),
        SequenceUpdate("stop_id", (55,), True, "stop"),
        SequenceUpdate("ignore", (2,), False, None),
    ]
    assert sched.update(sched.schedule(), {"ignore": 2}) == [
        SequenceUpdate("ignore", (2,), True, "length")
    ]
    assert not sched.has_unfinished()
    assert sched.kv.num_free_blocks == 64


def test_finish_from_outside_frees_blocks() -> None:
    sched = make()
    sched.add(seq("A", 5))
    step(sched)
    assert sched.finish("A", "stop") is True
    assert sched.finish("A", "stop") is False
    assert sched.kv.num_free_blocks == 64
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish("A", "bored")


def test_update_rejects_sampled_tokens_that_do_not_match_the_plan() -> None:
    sched = make()
    sched.add(seq("A", 20))
    plan = sched.schedule()  # a 16-token chunk: no sampling
    with pytest.raises(ValueError, match=r"not sampling this step \['A'\]"):
        sched.update(plan, {"A": 1})
    sched.update(plan, {})
    plan = sched.schedule()
    with pytest.raises(ValueError, match=r"missing \['A'\]"):
        sched.update(plan, {})


def test_add_validates_sequences() -> None:
    sched = make(num_blocks=4)  # 16 tokens of KV
    sched.add(seq("A", 3))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(seq("A", 3))
    with pytest.raises(ValueError, match="max_model_len=16"):
        sched.add(seq("B", 16))
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence("C", [])
    assert sched.num_waiting == 1


def test_config_validates_itself() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=0)
    assert SchedulerConfig().max_chunk_tokens == 2048


def test_engine_loop_runs_everything_to_completion_under_pressure() -> None:
    sched = make(num_blocks=8, budget=8, max_seqs=3)
    seqs = [seq(f"s{i}", 5 + i, first=100 * i, max_tokens=6) for i in range(5)]
    for s in seqs:
        sched.add(s)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        assert step(sched).num_batched_tokens <= 8
    assert not sched.has_unfinished()
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)
    assert all(s.output_token_ids == [7] * 6 for s in seqs)
    assert sched.kv.num_free_blocks == 8
    stats = sched.stats()
    assert stats.num_running == 0
    assert stats.num_preemptions > 0  # 3 x 4 blocks do not fit in 8: the test had pressure


def test_token_view_reads_prompt_and_outputs_without_copying() -> None:
    s = Sequence("v", [1, 2, 3], output_token_ids=[4, 5])
    view = s.token_view
    assert len(view) == 5
    assert list(view) == s.all_token_ids == [1, 2, 3, 4, 5]
    assert (view[0], view[3], view[-1]) == (1, 4, 5)
    assert (view[1:4], view[3:], view[:2], view[::2], view[4:2]) == (
        [2, 3, 4],
        [4, 5],
        [1, 2],
        [1, 3, 5],
        [],
    )
    s.output_token_ids.append(6)
    assert len(view) == 6 and view[-1] == 6
    with pytest.raises(IndexError, match="out of range"):
        view[6]
