"""Verification keeps the target distribution: seeded samples through a token tree against
the exact distribution, and a deliberately wrong acceptance rule that fails the same bound."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import torch

from pdserve.engine.sampler import Sampler, SampleRequest, SampleResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler.token_tree import TokenTree
from pdserve.engine.speculative.verify import (
    DrawFn,
    greedy_draw,
    kv_moves,
    target_draw,
    verify_tree,
)

VOCAB = 4
SAMPLES = 4000
# Statistical noise of the total-variation distance over 16 outcomes at 4,000 samples is
# about 0.025; the wrong rule below is off by about 0.17.
TV_BOUND = 0.06

# root -> every token; each child row has its own distribution (rows 1..4 = tokens 0..3)
TREE = TokenTree.from_branches([[t] for t in range(VOCAB)], max_nodes=VOCAB)
LOGITS = torch.tensor(
    [
        [1.0, 0.2, -0.5, 0.4],  # the root's row
        [0.0, 1.5, -1.0, 0.3],
        [-0.7, 0.1, 0.9, 0.0],
        [0.5, 0.5, 0.5, -2.0],
        [2.0, -1.0, 0.0, 0.2],
    ]
)
PARAMS = SamplingParams(temperature=0.8, top_k=3, max_tokens=8)


def exact_pairs() -> dict[tuple[int, int], float]:
    """P(x1, x2) of decoding without speculation: x1 from the root row, x2 from x1's row."""

    def probs(row: int) -> torch.Tensor:
        logits = LOGITS[row] / PARAMS.temperature
        kth = logits.topk(PARAMS.top_k).values[-1]
        return logits.masked_fill(logits < kth, -torch.inf).softmax(-1)

    first = probs(0)
    return {
        (a, b): float(first[a] * probs(TREE.children()[0][a])[b])
        for a in range(VOCAB)
        for b in range(VOCAB)
    }


def sample_pairs(make_draw) -> Counter[tuple[int, int]]:  # type: ignore[no-untyped-def]
    sampler = Sampler()
    counts: Counter[tuple[int, int]] = Counter()
    for seed in range(SAMPLES):
        request = SampleRequest(dataclasses.replace(PARAMS, seed=seed), [9], [])
        verified = verify_tree(TREE, make_draw(sampler, request))
        assert verified.num_accepted == 1  # every first draw is a child of the root
        counts[verified.token_ids[0], verified.token_ids[1]] += 1
    return counts


def total_variation(counts: Counter[tuple[int, int]]) -> float:
    exact = exact_pairs()
    return 0.5 * sum(abs(counts[k] / SAMPLES - p) for k, p in exact.items())


def test_sampling_through_the_tree_keeps_the_target_distribution() -> None:
    def draw(sampler: Sampler, request: SampleRequest) -> DrawFn:
        return target_draw(sampler, LOGITS, request)

    assert total_variation(sample_pairs(draw)) < TV_BOUND


def test_a_wrong_acceptance_rule_fails_the_same_bound() -> None:
    """The classic mistake: accept the first candidate with its target probability and, on
    rejection, draw from the target again without removing it (so it is chosen too often)."""

    def wrong(sampler: Sampler, request: SampleRequest) -> DrawFn:
        right = target_draw(sampler, LOGITS, request)
        rng = torch.Generator().manual_seed(request.params.seed or 0)

        def draw(row: int, accepted: Sequence[int]) -> SampleResult:
            if row == 0:
                candidate = TREE.tokens[0]
                probs = (LOGITS[0] / PARAMS.temperature).softmax(-1)
                if torch.rand(1, generator=rng).item() < probs[candidate]:
                    return SampleResult(candidate, None, ())
            return right(row, accepted)

        return draw

    assert total_variation(sample_pairs(wrong)) > TV_BOUND


def test_a_seeded_draw_is_the_draw_decoding_would_make() -> None:
    """Same seed, same output length: the verified token equals the plain sampler's."""
    sampler = Sampler()
    for seed in range(50):
        params = SamplingParams(temperature=1.0, seed=seed)
        request = SampleRequest(params, [9], [5, 6])
        plain = sampler(LOGITS[:1], [request])[0].token_id
        verified = verify_tree(TREE, target_draw(sampler, LOGITS, request))
        assert verified.token_ids[0] == plain


def test_greedy_walks_the_argmax_and_moves_only_a_side_branch() -> None:
    tree = TokenTree.from_branches([[7, 8], [5, 6]], max_nodes=8)  # rows: 7=1, 8=2, 5=3, 6=4
    argmax = [5, 0, 0, 6, 4]  # root -> 5 (row 3) -> 6 (row 4) -> then 4, not a child
    verified = verify_tree(tree, greedy_draw(argmax))
    assert verified.token_ids == (5, 6, 4) and verified.accepted_rows == (3, 4)
    # rows 3, 4 hold depths 1, 2: with start 10 and block_size 4, table (0, 1, 2, 3)
    assert kv_moves(verified, 10, (0, 1, 2, 3), 4) == [(13, 11), (14, 12)]
    chain = verify_tree(tree, greedy_draw([7, 8, 3, 0, 0]))
    assert chain.token_ids == (7, 8, 3) and kv_moves(chain, 10, (0, 1, 2, 3), 4) == []
