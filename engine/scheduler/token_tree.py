"""A token tree of speculative candidates (SpecInfer), as the scheduler and the runner see it.

The tree hangs under the sequence's last known token (the *root*, not stored here). Nodes are
in preorder, parents before children, the most likely chain first::

    root ── a ── b ── c          tokens   (a, b, c, d, e)
       │     └── d               parents  (-1, 0, 1, 0, -1)     -1 = the root
       └── e                     depths   (1, 2, 3, 2, 1)

A verify chunk is ``(root, *tokens)``: chunk row ``i + 1`` holds node ``i``, whose position is
``root position + depth`` and which attends to the cached prefix, the root and its ancestors.
Its K/V is written to the slot of position ``root position + 1 + i`` (rows in order); after
verification the accepted path's K/V is moved to the slots of its real positions, so only a
chain that is not the first one needs a move. Pure Python: the scheduler imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class TokenTree:
    """Candidate tokens in preorder; ``parents[i]`` is an earlier node's index or -1 (root)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(
                f"a token tree needs one parent per token: {len(self.tokens)} tokens, "
                f"{len(self.parents)} parents"
            )
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} must be -1 or an earlier node")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_branches(cls, branches: Iterable[Sequence[int]], max_nodes: int) -> TokenTree:
        """Merge candidate continuations into a trie (shared prefixes once), best first.

        Nodes are taken branch by branch until ``max_nodes``; a branch cut short keeps its
        head. The first branch becomes the first chain, so it needs no K/V move.
        """
        children: list[dict[int, int]] = [{}]  # trie node 0 = the root
        parent_of: list[int] = [-1]
        token_of: list[int] = [-1]
        for branch in branches:
            node = 0
            for token in branch:
                child = children[node].get(token)
                if child is None:
                    if len(token_of) - 1 >= max_nodes:
                        break
                    child = len(token_of)
                    children[node][token] = child
                    children.append({})
                    parent_of.append(node)
                    token_of.append(token)
                node = child
        order: list[int] = []  # preorder over trie ids, children in insertion order
        stack = list(reversed(children[0].values()))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(children[node].values()))
        index = {trie_id: i for i, trie_id in enumerate(order)}
        return cls(
            tokens=tuple(token_of[n] for n in order),
            parents=tuple(index.get(parent_of[n], -1) for n in order),
        )

    def truncated(self, max_nodes: int) -> TokenTree:
        """The first ``max_nodes`` nodes (a preorder prefix is still a tree)."""
        return TokenTree(self.tokens[:max_nodes], self.parents[:max_nodes])

    @property
    def first_chain_length(self) -> int:
        """Nodes on the first chain (node i's parent is node i - 1): what a single chain
        of candidates would have verified."""
        return next(
            (i for i, parent in enumerate(self.parents) if parent != i - 1), len(self.parents)
        )

    def children(self) -> list[dict[int, int]]:
        """Per chunk row (0 = root, ``i + 1`` = node ``i``): token -> the child's row."""
        rows: list[dict[int, int]] = [{} for _ in range(len(self.tokens) + 1)]
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            rows[parent + 1].setdefault(token, i + 1)
        return rows
