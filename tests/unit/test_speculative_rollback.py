"""Verify chunks on tiny pools: the rejected candidates' slots are rolled back exactly.

Each test runs two schedulers over the same token stream, one decoding a token per step and
one verifying token trees, and compares what the pool holds: block tables, reference counts,
the free queue and the prefix cache must be the same after every verify step.
"""

from __future__ import annotations

import pytest

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from pdserve.engine.scheduler.token_tree import TokenTree

BLOCK_SIZE = 4


# What the target "samples" at each position: position p -> token 100 + p.
def target(position: int) -> int:
    return 100 + position


def make(num_blocks: int = 12, budget: int = 32, max_seqs: int = 4) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, extra_keys=("model:test",))
    return Scheduler(SchedulerConfig(budget, max_seqs), kv)


def new_seq(seq_id: str, prompt_len: int = 6) -> Sequence:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    return Sequence(seq_id, list(range(prompt_len)), params)


def pool_state(sched: Scheduler, seq_id: str) -> tuple[object, ...]:
    kv = sched.kv
    table = kv.block_table(seq_id) if seq_id in kv else ()
    refs = tuple(kv.pool.ref_count(b) for b in range(kv.num_blocks))
    hashes = tuple(kv.pool.block_hash(b) for b in range(kv.num_blocks))
    return table, refs, tuple(kv.pool.free_block_ids()), hashes


def plain_step(sched: Scheduler) -> None:
    plan = sched.schedule()
    sched.update(plan, {c.seq_id: target(c.end_pos) for c in plan.chunks if c.sample})


def verify_step(sched: Scheduler, seq: Sequence, tree: TokenTree) -> tuple[int, ...]:
    """Schedule ``seq`` with ``tree`` and accept what the target would: returns the tokens."""
    seq.proposal = tree
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.tree == tree and chunk.token_ids[1:] == tree.tokens
    children, row, position, tokens = tree.children(), 0, chunk.start_pos, []
    while True:  # greedy walk: the target's token at each depth
        token = target(position + 1)
        tokens.append(token)
        if token not in children[row]:
            break
        row, position = children[row][token], position + 1
    sched.update(plan, {seq.seq_id: tuple(tokens)})
    return tuple(tokens)


@pytest.mark.parametrize(
    "tree_of",
    [
        pytest.param(lambda p: TokenTree.from_branches([[1, 2, 3, 4, 5]], 8), id="all-rejected"),
        pytest.param(
            lambda p: TokenTree.from_branches([[target(p + 1), target(p + 2), 9, 9, 9]], 8),
            id="chain-half-accepted",
        ),
        pytest.param(
            lambda p: TokenTree.from_branches(
                [[9, 9, 9, 9], [target(p + 1), target(p + 2), target(p + 3), 9]], 8
            ),
            id="second-branch-accepted",
        ),
        pytest.param(
            lambda p: TokenTree.from_branches([[target(p + i) for i in range(1, 8)]], 8),
            id="all-accepted",
        ),
    ],
)
def test_rollback_leaves_the_pool_as_decoding_would(tree_of) -> None:  # type: ignore[no-untyped-def]
    plain, spec = make(), make()
    plain.add(new_seq("s"))
    seq = new_seq("s")
    spec.add(seq)
    plain_step(plain)
    plain_step(spec)  # the prompt, identically
    for _ in range(4):
        tokens = verify_step(spec, seq, tree_of(seq.num_tokens - 1))
        for _token in tokens:
            plain_step(plain)
        assert plain.get("s").output_token_ids == seq.output_token_ids  # type: ignore[union-attr]
        assert pool_state(spec, "s") == pool_state(plain, "s")


def test_a_rejected_candidates_block_is_never_cached() -> None:
    sched = make()
    seq = new_seq("s", prompt_len=3)
    sched.add(seq)
    plain_step(sched)  # 3 prompt tokens + 1 sampled: position 3 pending
    tree = TokenTree.from_branches([[1, 2, 3, 4, 5, 6, 7, 8]], 8)  # rejected at once
    verify_step(sched, seq, tree)
    # the candidates took positions 4..11 (blocks 1 and 2); positions 0..3 (block 0) stay
    kv = sched.kv
    assert kv.block_table("s") == (0,)
    assert [kv.pool.block_hash(b) is not None for b in range(4)] == [True, False, False, False]
    assert kv.pool.free_block_ids()[:2] == [1, 2]  # the rolled-back blocks are reused first


def test_speculation_never_preempts_and_a_tree_that_does_not_fit_is_dropped() -> None:
    sched = make(num_blocks=4)
    a, b = new_seq("a", prompt_len=4), new_seq("b", prompt_len=4)
    sched.add(a)
    sched.add(b)
    plain_step(sched)  # both prefilled: 2 blocks each at position 4 -> 3 of 4 blocks used
    a.proposal = TokenTree.from_branches([[1, 2, 3, 4, 5, 6, 7, 8]], 8)  # needs 2 more blocks
    plan = sched.schedule()
    assert [c.tree for c in plan.chunks] == [None, None]
    assert not plan.preempted_seq_ids and sched.stats().num_preemptions == 0


def test_candidates_count_against_the_step_budget() -> None:
    sched = make(budget=6)
    a, b = new_seq("a"), new_seq("b", prompt_len=5)
    sched.add(a)
    sched.add(b)
    plain_step(sched)
    plain_step(sched)
    a.proposal = TokenTree.from_branches([[1, 2, 3, 4, 5, 6, 7, 8]], 8)
    plan = sched.schedule()
    # 6 tokens: b's decode keeps its one; a's tree is cut to what is left
    assert [c.num_tokens for c in plan.chunks] == [5, 1]
    assert plan.chunks[0].tree == TokenTree((1, 2, 3, 4), (-1, 0, 1, 2))
