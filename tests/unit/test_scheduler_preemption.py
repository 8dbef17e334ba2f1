"""Preemption by recompute on tiny pools: victim order, self-preemption, resumption, aborts."""

from __future__ import annotations

import random
from collections.abc import Mapping

import pytest

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import BatchPlan, Scheduler, SchedulerConfig, Sequence, SequenceStatus


def make(num_blocks: int, block_size: int, caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching, extra_keys=("model:test",))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4), kv)


def seq(seq_id: str, prompt_len: int, first: int, max_tokens: int = 16) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Sequence(seq_id, list(range(first, first + prompt_len)), params)


def shape(plan: BatchPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.seq_id, c.start_pos, c.num_tokens, c.sample) for c in plan.chunks]


def tables(plan: BatchPlan) -> dict[str, tuple[int, ...]]:
    return {c.seq_id: c.block_table for c in plan.chunks}


def step(sched: Scheduler, tokens: Mapping[str, int] | None = None) -> BatchPlan:
    plan = sched.schedule()
    sched.update(plan, {c.seq_id: (tokens or {}).get(c.seq_id, 7) for c in plan.chunks if c.sample})
    return plan


def test_newest_sequences_are_preempted_first_and_resume_before_new_ones() -> None:
    sched = make(num_blocks=4, block_size=2)
    seqs = {name: seq(name, 2, first=100 * i, max_tokens=2) for i, name in enumerate("ABCD")}
    for s in seqs.values():
        sched.add(s)
    p1 = step(sched)
    assert tables(p1) == {"A": (0,), "B": (1,), "C": (2,), "D": (3,)}
    # Every decode needs a new block and none is free: A takes D's, B takes C's.
    p2 = step(sched)
    assert shape(p2) == [("A", 2, 1, True), ("B", 2, 1, True)]
    assert p2.preempted_seq_ids == ("D", "C")
    assert tables(p2) == {"A": (0, 3), "B": (1, 2)}
    assert seqs["C"].status is SequenceStatus.PREEMPTED
    assert seqs["C"].num_computed_tokens == 0 and seqs["C"].output_token_ids == [7]
    # A and B finished (max_tokens=2) and freed tail first: queue [3, 0, 2, 1].
    sched.add(seq("E", 2, first=900))
    p3 = step(sched)
    assert shape(p3) == [("C", 0, 3, True), ("D", 0, 3, True)]  # prompt + kept output
    assert p3.chunks[0].token_ids == (200, 201, 7)
    assert tables(p3) == {"C": (3, 0), "D": (2, 1)}
    assert seqs["C"].status is SequenceStatus.FINISHED_LENGTH  # its 2nd token came now
    assert sched.stats().num_preemptions == 2


def test_a_sequence_preempts_itself_when_it_is_the_newest() -> None:
    sched = make(num_blocks=3, block_size=4)
    sched.add(seq("A", 6, first=0))
    sched.add(seq("B", 4, first=100))
    assert tables(step(sched)) == {"A": (0, 1), "B": (2,)}
    p2 = step(sched)
    assert shape(p2) == [("A", 6, 1, True)]  # A fits in its block; B needs one, none free
    assert p2.preempted_seq_ids == ("B",)
    assert sched.num_waiting == 1 and sched.num_running == 1
    # B would hit its cached prompt block but still needs 2 free blocks: it waits.
    p3 = step(sched)
    assert shape(p3) == [("A", 7, 1, True)]
    assert p3.preempted_seq_ids == ()


@pytest.mark.parametrize("caching", [True, False])
def test_resumed_sequence_recomputes_prompt_and_outputs(caching: bool) -> None:
    sched = make(num_blocks=4, block_size=4, caching=caching)
    sched.add(seq("A", 8, first=0, max_tokens=2))
    sched.add(seq("B", 4, first=1000))
    step(sched, {"A": 500, "B": 600})
    p2 = step(sched)
    assert p2.preempted_seq_ids == ("B",)
    assert tables(p2) == {"A": (0, 1, 3)}
    p3 = step(sched, {"B": 601})  # A finished; B resumes into blocks [2, 3]
    b = sched.get("B")
    assert b is not None
    if caching:  # its prompt block was still cached: only the output token is recomputed
        assert shape(p3) == [("B", 4, 1, True)]
        assert p3.chunks[0].token_ids == (600,)
        assert b.num_cached_tokens == 4
    else:
        assert shape(p3) == [("B", 0, 5, True)]
        assert p3.chunks[0].token_ids == (1000, 1001, 1002, 1003, 600)
    assert tables(p3) == {"B": (2, 3)}
    assert b.output_token_ids == [600, 601]
    assert shape(step(sched)) == [("B", 5, 1, True)]


def test_abort_frees_blocks_wherever_the_sequence_is() -> None:
    sched = make(num_blocks=8, block_size=4)
    sched.add(seq("A", 6, first=0))
    sched.add(seq("B", 6, first=100))
    step(sched)
    sched.add(seq("W", 3, first=200))
    assert sched.kv.num_free_blocks == 4
    assert sched.abort("A") is True
    assert sched.abort("A") is False
    assert sched.kv.num_free_blocks == 6
    assert sched.abort("W") is True  # still waiting: nothing to free
    assert sched.num_waiting == 0
    plan = sched.schedule()
    assert sched.abort("B") is True  # between schedule() and update()
    assert sched.update(plan, {"B": 1}) == []
    assert sched.kv.num_free_blocks == 8
    assert not sched.has_unfinished()


class FakeKV:
    """A stand-in for the KV tensor: slot (block, offset) holds the prefix that produced it.

    Position p of a sequence must hold exactly ``tokens[: p + 1]`` whenever it is read, which
    checks prefix-cache hits, copy-on-write and recompute end to end.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def execute(self, plan: BatchPlan, seqs: Mapping[str, Sequence]) -> None:
        for src, dst in plan.block_copies:
            for offset in range(self.block_size):
                if (src, offset) in self.slots:
                    self.slots[(dst, offset)] = self.slots[(src, offset)]
        for chunk in plan.chunks:  # writes of the whole batch land before any read
            tokens = seqs[chunk.seq_id].all_token_ids
            for pos in range(chunk.start_pos, chunk.end_pos):
                self.slots[self._slot(chunk.block_table, pos)] = tuple(tokens[: pos + 1])
        for chunk in plan.chunks:
            tokens = seqs[chunk.seq_id].all_token_ids
            for pos in range(chunk.end_pos):
                held = self.slots.get(self._slot(chunk.block_table, pos))
                assert held == tuple(tokens[: pos + 1]), f"{chunk.seq_id} pos {pos} is stale"

    def _slot(self, table: tuple[int, ...], pos: int) -> tuple[int, int]:
        return table[pos // self.block_size], pos % self.block_size


def _check_ref_counts(sched: Scheduler, live: Mapping[str, Sequence]) -> None:
    counts: dict[int, int] = {}
    for seq_id in live:
        if seq_id in sched.kv:
            for block in sched.kv.block_table(seq_id):
                counts[block] = counts.get(block, 0) + 1
    for block in range(sched.kv.num_blocks):
        assert sched.kv.pool.ref_count(block) == counts.get(block, 0), f"block {block}"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chunked", [True, False])
def test_random_workload_keeps_kv_consistent(seed: int, chunked: bool) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(10, 4, extra_keys=("model:test",))
    config = SchedulerConfig(
        max_num_batched_tokens=12, max_num_seqs=4, enable_chunked_prefill=chunked
    )
    sched, fake = Scheduler(config, kv), FakeKV(4)
    live: dict[str, Sequence] = {}
    shared_prefix = [5, 6, 7, 8, 9, 10]
    for i in range(12):
        n = rng.choice([1, 1, 2, 3])
        prompt = shared_prefix[: rng.randint(0, 6)] + [
            rng.randrange(50) for _ in range(rng.randint(1, 14))
        ]
        params = SamplingParams(max_tokens=rng.randint(1, 8), n=n)
        group = [Sequence(f"r{i}#{k}", prompt, params, eos_token_id=0) for k in range(n)]
        live.update((s.seq_id, s) for s in group)
        sched.add_group(group)
    num_copies_and_preemptions = 0
    for _ in range(400):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        num_copies_and_preemptions += len(plan.block_copies) + len(plan.preempted_seq_ids)
        for chunk in plan.chunks:
            assert chunk.start_pos == live[chunk.seq_id].num_computed_tokens
        fake.execute(plan, live)
        sampled = {c.seq_id: rng.randrange(40) for c in plan.chunks if c.sample}
        sched.update(plan, sampled)
        if rng.random() < 0.05 and plan.chunks:
            sched.abort(rng.choice(plan.chunks).seq_id)
        _check_ref_counts(sched, live)
    assert not sched.has_unfinished()
    assert all(s.is_finished for s in live.values())
    assert kv.num_free_blocks == 10
    # The workload did exercise the tricky paths (checked for these seeds).
    assert kv.prefix_hit_tokens > 0 and num_copies_and_preemptions > 0
