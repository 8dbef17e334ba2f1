"""Prompt lookup: candidates are what followed earlier occurrences of the last few tokens.

For the last ``n`` tokens (``n`` from ``ngram_max`` down to ``ngram_min``) every earlier
place in prompt + output where the same ``n`` tokens occur proposes the tokens that came
next; longer matches first, then the most recent. Distinct continuations become branches
of one token tree (shared heads merged). Copy-heavy work (editing, summarising, code) repeats
long runs of its prompt, which this finds for the price of a dictionary lookup.

Per sequence an index maps each n-gram to where it ended, extended by the new tokens only.
Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.scheduler.token_tree import TokenTree
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.policy import ProposalLimits, ProposalRequest

# Occurrences looked at per n-gram (most recent first): bounds the cost on repetitive text.
_MAX_OCCURRENCES = 8


@dataclass(slots=True)
class _NgramIndex:
    """``ends[n][gram]``: indices just past each earlier occurrence of ``gram`` (length n)."""

    ends: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)
    indexed_to: int = 0  # occurrences ending before this index are in ``ends``


class NgramProposer:
    """Token trees from prompt lookup; one index per live sequence."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self._sizes = range(config.ngram_max, config.ngram_min - 1, -1)
        self._branches = config.ngram_branches
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, requests: Sequence[ProposalRequest]) -> dict[str, TokenTree]:
        trees = {}
        for request in requests:
            tree = self._propose_one(request.seq_id, request.token_ids, request.limits)
            if tree is not None:
                trees[request.seq_id] = tree
        return trees

    def _propose_one(
        self, seq_id: str, token_ids: Sequence[int], limits: ProposalLimits
    ) -> TokenTree | None:
        tokens = list(token_ids)
        index = self._indexes.setdefault(seq_id, _NgramIndex())
        self._extend(index, tokens)
        branches: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in self._sizes:
            if len(tokens) <= n:
                continue
            ends = index.ends.get(n, {}).get(tuple(tokens[-n:]), ())
            for end in reversed(ends[-_MAX_OCCURRENCES:]):
                branch = tokens[end : end + limits.max_depth]
                if tuple(branch) not in seen:
                    seen.add(tuple(branch))
                    branches.append(branch)
                if len(branches) == self._branches:
                    return TokenTree.from_branches(branches, limits.max_nodes)
        return TokenTree.from_branches(branches, limits.max_nodes) if branches else None

    def forget(self, seq_id: str) -> None:
        self._indexes.pop(seq_id, None)

    def _extend(self, index: _NgramIndex, tokens: list[int]) -> None:
        """Index every occurrence that ends before the last token (so it has a next one)."""
        for n in self._sizes:
            table = index.ends.setdefault(n, {})
            for end in range(max(n, index.indexed_to), len(tokens)):
                table.setdefault(tuple(tokens[end - n : end]), []).append(end)
        index.indexed_to = len(tokens)
