"""A draft model proposes: a smaller model with the same tokenizer, in the same worker.

Per step, for the sequences that speculate: one forward catches each sequence up (the
tokens the target accepted since the draft last saw it, usually 1 to a few), then one
single-token forward per depth extends its greedy chain. The tree is that chain plus, at each
depth, the draft's second choice as a one-token branch (SpecInfer's top-k expansion at
width 2): when the draft's first choice is wrong, its second is often right.

The draft has its own small paged pool (no prefix caching). Its K/V stays valid for the
tokens the target kept: on the next step the common prefix of what the draft computed and
the sequence's tokens is kept, the rest rolled back. When the pool is full, the draft state
of sequences not in this step is dropped, oldest first (they catch up from the start later).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk
from pdserve.engine.scheduler.token_tree import TokenTree
from pdserve.engine.speculative.policy import ProposalRequest


@dataclass(slots=True)
class _Drafting:
    """One sequence being drafted this step."""

    seq_id: str
    tokens: list[int]  # the sequence's tokens (the last one not yet in the target's cache)
    depth: int
    max_nodes: int
    chain: list[int] = field(default_factory=list)  # the draft's first choices
    alternatives: list[int] = field(default_factory=list)  # its second choice at each depth

    def tree(self) -> TokenTree:
        seconds = [[*self.chain[:d], alt] for d, alt in enumerate(self.alternatives)]
        return TokenTree.from_branches([self.chain, *seconds], self.max_nodes)


class DraftModelProposer:
    """Greedy chains with second-choice branches from a draft model (see module docstring)."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_model_len: int) -> None:
        self._runner = runner
        self._kv = kv
        self._max_len = max_model_len
        self._computed: dict[str, list[int]] = {}  # tokens whose K/V is in the draft pool

    def propose(self, requests: Sequence[ProposalRequest]) -> dict[str, TokenTree]:
        active = {r.seq_id for r in requests}
        states: list[_Drafting] = []
        chunks: list[ScheduledChunk] = []
        for request in requests:
            tokens = list(request.token_ids)
            depth = min(request.limits.max_depth, self._max_len - len(tokens))
            chunk = self._catch_up(request.seq_id, tokens, active) if depth > 0 else None
            if chunk is not None:
                states.append(_Drafting(request.seq_id, tokens, depth, request.limits.max_nodes))
                chunks.append(chunk)
        trees: dict[str, TokenTree] = {}
        while states:
            plan = BatchPlan(tuple(chunks), tuple(self._kv.take_block_copies()))
            top2 = self._runner.execute(plan).topk(2, dim=-1).indices.tolist()  # [n, 2]
            going: list[_Drafting] = []
            chunks = []
            for state, (first, second) in zip(states, top2, strict=True):
                state.chain.append(first)
                state.alternatives.append(second)
                chunk = self._next_chunk(state, active) if len(state.chain) < state.depth else None
                if chunk is None:
                    self._computed[state.seq_id] = state.tokens + state.chain[:-1]
                    trees[state.seq_id] = state.tree()
                else:
                    going.append(state)
                    chunks.append(chunk)
            states = going
        return trees

    def forget(self, seq_id: str) -> None:
        if self._computed.pop(seq_id, None) is not None:
            self._kv.free(seq_id)

    def _catch_up(self, seq_id: str, tokens: list[int], active: Set[str]) -> ScheduledChunk | None:
        """The chunk of ``tokens`` the draft has not computed (at least the last one)."""
        kept = 0
        done = self._computed.pop(seq_id, None)  # re-inserted last: the dict is LRU-ordered
        if done is not None:
            kept = min(_common_prefix(done, tokens), len(tokens) - 1)
            self._kv.truncate(seq_id, kept)
            self._computed[seq_id] = tokens[:kept]
        table = self._allocate(seq_id, tokens, kept, len(tokens) - kept, active)
        if table is None:
            return None
        self._computed.setdefault(seq_id, [])
        return ScheduledChunk(seq_id, tuple(tokens[kept:]), kept, tuple(table), sample=True)

    def _next_chunk(self, state: _Drafting, active: Set[str]) -> ScheduledChunk | None:
        """The chain's newest token, to draft the next depth; None when blocks are short."""
        tokens = state.tokens + state.chain
        position = len(tokens) - 1
        table = self._allocate(state.seq_id, tokens, position, 1, active)
        if table is None:
            return None
        return ScheduledChunk(state.seq_id, (tokens[-1],), position, tuple(table), sample=True)

    def _allocate(
        self, seq_id: str, tokens: list[int], computed: int, num_new: int, active: Set[str]
    ) -> list[int] | None:
        """Blocks for ``num_new`` tokens, dropping idle sequences' draft state to find them."""
        while True:
            table = self._kv.allocate(seq_id, tokens, computed, num_new)
            if table is not None:
                return table
            idle = next((s for s in self._computed if s not in active), None)
            if idle is None:
                return None
            self.forget(idle)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
