"""How much each sequence speculates this step (pure).

Two limits, both from what speculation costs and earns:

* the batch: a step speculates only while ``decoding sequences + candidates`` fits
  ``max_verify_tokens``; the spare tokens are shared evenly. While a step is bound by
  reading the weights, a few more rows cost little (on the 2-core CPU of
  docs/benchmarks.md, verifying 4 candidates took 1.12x a decode step, 16 took 2.18x);
  once the batch fills the step, every candidate costs a row's full share and can only
  lose, so speculation stops.
* the sequence's record: the depth follows the mean accepted length (exponentially
  weighted), so a sequence whose candidates keep failing proposes short ones, and one whose
  candidates are all accepted proposes up to ``num_speculative_tokens``. Below
  ``min_acceptance`` a verify step no longer earns its cost (a step of a few more tokens
  costs a fraction of a decode step more: see docs/speculative.md) and the sequence pauses;
  its mean creeps back up while it pauses, so it tries again after about 15 steps (text
  that starts repeating itself is found again).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.speculative.config import SpeculativeConfig

# Weight of the newest step in the running mean of accepted candidates.
_EMA_WEIGHT = 0.3
# While a sequence pauses, its mean rises by this much per step (a probe every ~15 steps
# after a failed one: mean 0.7 * 0.5 = 0.35 back to 0.5).
_RECOVERY_PER_STEP = 0.01


@dataclass(slots=True, frozen=True)
class ProposalLimits:
    max_depth: int
    max_nodes: int


@dataclass(slots=True, frozen=True)
class ProposalRequest:
    """One sequence a proposer drafts for: its tokens (the last one not in the target's
    cache yet) and how far it may go."""

    seq_id: str
    token_ids: Sequence[int]
    limits: ProposalLimits


class SpeculationPolicy:
    """Per-sequence limits for the next step, from the batch and each sequence's record."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self._config = config
        self._mean_accepted: dict[str, float] = {}

    def limits(self, seq_id: str, num_decoding: int) -> ProposalLimits | None:
        """None: this sequence does not speculate this step."""
        config = self._config
        spare = config.max_verify_tokens - num_decoding
        nodes = min(config.max_tree_nodes, spare // max(1, num_decoding))
        if nodes < 1:
            return None
        mean = self._mean_accepted.get(seq_id, float(config.num_speculative_tokens))
        if mean < config.min_acceptance:
            self._mean_accepted[seq_id] = mean + _RECOVERY_PER_STEP
            return None
        depth = min(config.num_speculative_tokens, math.ceil(mean) + 1, nodes)
        return ProposalLimits(max_depth=depth, max_nodes=nodes)

    def record(self, seq_id: str, num_accepted: int) -> None:
        """After a verify step: ``num_accepted`` candidates were kept."""
        mean = self._mean_accepted.get(seq_id, float(self._config.num_speculative_tokens))
        self._mean_accepted[seq_id] = (1 - _EMA_WEIGHT) * mean + _EMA_WEIGHT * num_accepted

    def forget(self, seq_id: str) -> None:
        self._mean_accepted.pop(seq_id, None)
