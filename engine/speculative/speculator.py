"""What the engine calls around a step: propose before ``schedule``, verify after the forward.

::

    speculator.propose(scheduler.decoding(), max_model_len)   # sets seq.proposal
    plan = scheduler.schedule()                                # trees ride in verify chunks
    logits = runner.execute(plan)
    verified = speculator.verify(chunk, draw)                  # per verify chunk
    runner.move_slots(kv_moves(...))                           # accepted K/V to its place
    scheduler.update(plan, {seq_id: verified.token_ids, ...})  # rolls back the rest
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.scheduler import Sequence
from pdserve.engine.scheduler.plan import ScheduledChunk
from pdserve.engine.scheduler.token_tree import TokenTree
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.policy import ProposalLimits, ProposalRequest, SpeculationPolicy
from pdserve.engine.speculative.verify import DrawFn, Verified, verify_tree

log = logging.getLogger(__name__)


class Proposer(Protocol):
    def propose(self, requests: SequenceABC[ProposalRequest]) -> dict[str, TokenTree]: ...

    def forget(self, seq_id: str) -> None: ...


@dataclass(slots=True)
class SpeculationStats:
    """Counters since the engine started (Prometheus reads them through the worker)."""

    verify_steps: int = 0  # verify chunks run
    proposed_tokens: int = 0  # candidates verified
    accepted_tokens: int = 0  # candidates kept
    chain_tokens: int = 0  # candidates on each tree's first chain (a single chain's share)
    branch_accepted_tokens: int = 0  # kept candidates off the first chain: the tree's gain
    # accepted candidates per verify chunk -> how many chunks (the acceptance length)
    acceptance_lengths: Counter[int] = field(default_factory=Counter)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / max(1, self.proposed_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify chunk: the accepted candidates plus the one drawn after them."""
        return 1.0 + self.accepted_tokens / max(1, self.verify_steps)


class Speculator:
    """A proposer, the adaptive policy and the counters, for one engine."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self._proposer = proposer
        self._policy = SpeculationPolicy(config)
        self.stats = SpeculationStats()

    def propose(self, decoding: list[Sequence], max_model_len: int) -> None:
        """Set ``proposal`` on the decoding sequences that speculate this step."""
        requests = []
        for seq in decoding:
            limits = self._policy.limits(seq.seq_id, len(decoding))
            if limits is None:
                return  # the batch is too large for speculation to pay
            # Never past the request's max_tokens or the context: the last token is drawn.
            room = min(
                seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens
            )
            depth = min(limits.max_depth, room - 1)
            if seq.params.speculative and depth >= 1:
                limits = ProposalLimits(depth, limits.max_nodes)
                requests.append(ProposalRequest(seq.seq_id, seq.token_view, limits))
        if requests:
            trees = self._proposer.propose(requests)
            for seq in decoding:
                seq.proposal = trees.get(seq.seq_id)

    def verify(self, chunk: ScheduledChunk, draw: DrawFn) -> Verified:
        assert chunk.tree is not None, f"{chunk.seq_id!r}'s chunk has no tree to verify"
        verified = verify_tree(chunk.tree, draw)
        stats = self.stats
        stats.verify_steps += 1
        stats.proposed_tokens += len(chunk.tree)
        stats.accepted_tokens += verified.num_accepted
        stats.chain_tokens += chunk.tree.first_chain_length
        stats.branch_accepted_tokens += sum(
            1 for depth, row in enumerate(verified.accepted_rows, start=1) if row != depth
        )
        stats.acceptance_lengths[verified.num_accepted] += 1
        self._policy.record(chunk.seq_id, verified.num_accepted)
        return verified

    def forget(self, seq_id: str) -> None:
        """The sequence is done: drop its index, draft state and record."""
        self._proposer.forget(seq_id)
        self._policy.forget(seq_id)
