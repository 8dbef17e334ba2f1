"""Verifying a token tree against the target model's logits, without changing the output.

Every proposer here is deterministic (prompt lookup, or a draft model's top choices), so a
candidate's draft probability is 1 and SpecInfer's multi-branch speculative sampling reduces
to: at the root, draw the next token from the *target* distribution exactly as decoding
without speculation would (same penalties, temperature, top-k/p, and the same seeded noise,
which depends only on the output length); if the draw equals a child's token, accept that
child and draw again from its row; else the draw is the step's last token. Each emitted
token is therefore a draw from the target distribution given the tokens before it: greedy
output is token-identical, sampled output has the target distribution, and a seeded request
gives the same tokens with speculation on or off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.sampler import Sampler, SampleRequest, SampleResult
from pdserve.engine.scheduler.token_tree import TokenTree

# Picks the token at one chunk row: (row, tokens accepted before it this step) -> result.
DrawFn = Callable[[int, Sequence[int]], SampleResult]


@dataclass(slots=True, frozen=True)
class Verified:
    """The outcome for one verify chunk."""

    token_ids: tuple[int, ...]  # accepted candidates, then the token drawn after them
    results: tuple[SampleResult, ...]  # one per token (logprobs)
    accepted_rows: tuple[int, ...]  # chunk rows of the accepted candidates, by depth

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_rows)


def verify_tree(tree: TokenTree, draw: DrawFn) -> Verified:
    """Walk ``tree`` from the root row (0), drawing at each row and descending while the
    draw is a child's token."""
    children = tree.children()
    tokens: list[int] = []
    results: list[SampleResult] = []
    accepted: list[int] = []
    row = 0
    while True:
        result = draw(row, tokens)
        tokens.append(result.token_id)
        results.append(result)
        child = children[row].get(result.token_id)
        if child is None:
            return Verified(tuple(tokens), tuple(results), tuple(accepted))
        accepted.append(child)
        row = child


def greedy_draw(argmax: Sequence[int]) -> DrawFn:
    """A plain greedy request: the row's argmax, computed for every row at once."""
    return lambda row, _accepted: SampleResult(argmax[row], None, ())


def target_draw(sampler: Sampler, logits: torch.Tensor, request: SampleRequest) -> DrawFn:
    """Draw as decoding without speculation would, with the candidates so far as output.
    ``logits``: ``[chunk rows, vocab]``, root first."""

    def draw(row: int, accepted: Sequence[int]) -> SampleResult:
        output = [*request.output_token_ids, *accepted]
        row_request = SampleRequest(
            request.params, request.prompt_token_ids, output, request.seed_salt
        )
        return sampler(logits[row : row + 1], [row_request])[0]

    return draw


def kv_moves(
    verified: Verified, start_pos: int, block_table: Sequence[int], block_size: int
) -> list[tuple[int, int]]:
    """Slot moves ``(src, dst)`` that put accepted candidates' K/V at their positions.

    Row ``r`` was written to position ``start_pos + r``'s slot; the candidate at depth
    ``d`` belongs at ``start_pos + d``. The first chain (row == depth) needs none.
    """

    def slot(position: int) -> int:
        return block_table[position // block_size] * block_size + position % block_size

    return [
        (slot(start_pos + row), slot(start_pos + depth))
        for depth, row in enumerate(verified.accepted_rows, start=1)
        if row != depth
    ]
