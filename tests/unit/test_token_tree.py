"""Token trees: merging branches into a trie in preorder, cutting, ancestry."""

from __future__ import annotations

import pytest

from pdserve.engine.attention.base import row_depths, tree_ancestors
from pdserve.engine.scheduler.token_tree import TokenTree


def test_branches_merge_their_shared_heads_and_the_first_stays_the_first_chain() -> None:
    tree = TokenTree.from_branches([[5, 6, 7], [5, 8], [9]], max_nodes=10)
    #  root ─ 5 ─ 6 ─ 7
    #         └── 8
    #  └── 9
    assert tree.tokens == (5, 6, 7, 8, 9)
    assert tree.parents == (-1, 0, 1, 0, -1)
    rows = (-1, *(p + 1 for p in tree.parents))  # the verify chunk's row parents
    assert row_depths(rows) == [0, 1, 2, 3, 2, 1]
    # rows: 0 = root, node i = row i + 1
    assert tree.children() == [{5: 1, 9: 5}, {6: 2, 8: 4}, {7: 3}, {}, {}, {}]
    assert tree_ancestors(rows)[4] == 0b10011  # rows 0, 1 and 4


def test_max_nodes_cuts_later_branches_and_keeps_earlier_heads() -> None:
    tree = TokenTree.from_branches([[1, 2, 3], [4, 5, 6]], max_nodes=4)
    assert tree.tokens == (1, 2, 3, 4)
    assert tree.truncated(2) == TokenTree((1, 2), (-1, 0))


def test_duplicate_branches_add_nothing() -> None:
    assert TokenTree.from_branches([[1, 2], [1, 2], [1]], max_nodes=8).tokens == (1, 2)


@pytest.mark.parametrize(("tokens", "parents"), [((1, 2), (-1,)), ((1, 2), (-1, 1)), ((1,), (-2,))])
def test_a_malformed_tree_is_refused(tokens: tuple[int, ...], parents: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="parent"):
        TokenTree(tokens, parents)
