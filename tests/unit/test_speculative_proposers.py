"""Prompt lookup proposals and the adaptive policy (pure Python)."""

from __future__ import annotations

from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.ngram import NgramProposer
from pdserve.engine.speculative.policy import (
    ProposalLimits,
    ProposalRequest,
    SpeculationPolicy,
)

CONFIG = SpeculativeConfig(method="ngram", ngram_min=2, ngram_max=3, ngram_branches=3)


def propose(proposer: NgramProposer, tokens: list[int], depth: int = 4, nodes: int = 16):
    request = ProposalRequest("s", tokens, ProposalLimits(depth, nodes))
    return proposer.propose([request]).get("s")


def test_continuations_of_earlier_occurrences_become_branches_longest_match_first() -> None:
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 8, 7, 2, 3, 4, 5, 1, 2, 3]
    tree = propose(NgramProposer(CONFIG), tokens)
    assert tree is not None
    # (1, 2, 3) occurred at 0..2 -> next 9 8 7 2; (2, 3) also at 6..7 -> next 4 5 1 2
    assert tree.tokens[:4] == (9, 8, 7, 2)
    assert tree.tokens[4:] == (4, 5, 1, 2)
    assert tree.parents == (-1, 0, 1, 2, -1, 4, 5, 6)


def test_no_earlier_occurrence_proposes_nothing() -> None:
    assert propose(NgramProposer(CONFIG), [1, 2, 3, 4, 5, 6]) is None


def test_the_index_grows_with_the_sequence() -> None:
    proposer = NgramProposer(CONFIG)
    tokens = [4, 5, 6, 7]
    assert propose(proposer, tokens) is None
    tokens += [8, 4, 5]
    tree = propose(proposer, tokens, depth=3)
    assert tree is not None and tree.tokens == (6, 7, 8)
    proposer.forget("s")
    assert propose(proposer, [1, 2]) is None  # a fresh index


def test_depth_and_nodes_limit_the_tree() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    tree = propose(NgramProposer(CONFIG), tokens, depth=2, nodes=1)
    assert tree is not None and tree.tokens == (3,)


def test_policy_stops_speculating_when_the_batch_fills_the_verify_budget() -> None:
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", max_verify_tokens=16))
    assert policy.limits("a", num_decoding=1) == ProposalLimits(max_depth=8, max_nodes=15)
    limits = policy.limits("a", num_decoding=4)
    assert limits is not None and limits.max_nodes == 3  # (16 - 4) // 4
    assert policy.limits("a", num_decoding=16) is None


def test_policy_depth_follows_the_acceptance_record() -> None:
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=8))
    for accepted in (8, 2, 2, 2, 2, 2, 2, 2, 2, 2):
        policy.record("fair", accepted)
        policy.record("good", 8)
    fair, good = policy.limits("fair", 1), policy.limits("good", 1)
    assert fair is not None and good is not None
    assert fair.max_depth == 4 and good.max_depth == 8  # one past the mean, rounded up


def test_a_sequence_whose_candidates_fail_pauses_then_tries_again() -> None:
    config = SpeculativeConfig(method="ngram", min_acceptance=0.5)
    policy = SpeculationPolicy(config)
    for _ in range(20):
        policy.record("bad", 0)
    paused = 0
    while policy.limits("bad", 1) is None:
        paused += 1
        assert paused < 100, "a paused sequence never tries again"
    assert paused > 10
    policy.forget("bad")
    assert policy.limits("bad", 1) == SpeculationPolicy(config).limits("new", 1)  # a fresh start
