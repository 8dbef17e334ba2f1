"""A worker engine's counters at one moment, as GetStats and the cluster agent read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.kv_cache.tiers import TierStats

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.speculative.speculator import Speculator


@dataclass(slots=True, frozen=True)
class SpeculationCounts:
    """Speculative decoding's counters since the engine started; zeros when it never
    speculates (speculation off, or the prefill role)."""

    verify_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    branch_accepted_tokens: int = 0  # accepted off each tree's first chain
    # index i: verify chunks that accepted i candidates, i = 0..num_speculative_tokens
    # (empty when off: the histogram's buckets come from the configured depth)
    acceptance_length_counts: tuple[int, ...] = ()


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A snapshot taken between two steps."""

    waiting: int
    running: int
    held: int  # prefill role: finished, KV kept until released (sent)
    pending_admissions: int  # decode role: KV landed, waiting for a running slot
    free_blocks: int  # includes free blocks that still cache a prefix
    cached_blocks: int
    total_blocks: int
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    prompt_tokens: int  # prompts of requests accepted here (imported ones included)
    generated_tokens: int  # tokens this engine sampled
    speculation: SpeculationCounts
    tiers: TierStats = field(default_factory=TierStats)


def engine_stats(
    engine: LLMEngine, pending_admissions: int, prompt_tokens: int, generated_tokens: int
) -> EngineStats:
    """Read ``engine`` (on its own thread) plus the counters its async wrapper keeps."""
    sched = engine.scheduler.stats()
    kv = engine.kv
    return EngineStats(
        waiting=sched.num_waiting,
        running=sched.num_running,
        held=sched.num_held,
        pending_admissions=pending_admissions,
        free_blocks=kv.num_free_blocks,
        cached_blocks=len(kv.cached_block_hashes()),
        total_blocks=kv.num_blocks,
        prefix_hit_tokens=sched.prefix_hit_tokens,
        prefix_queried_tokens=sched.prefix_queried_tokens,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated_tokens,
        speculation=speculation_counts(engine.speculator),
        tiers=engine.tier_stats(),
    )


def speculation_counts(speculator: Speculator | None) -> SpeculationCounts:
    if speculator is None:
        return SpeculationCounts()
    stats = speculator.stats
    lengths = stats.acceptance_lengths
    num_lengths = max([speculator.config.num_speculative_tokens, *lengths]) + 1
    return SpeculationCounts(
        verify_steps=stats.verify_steps,
        proposed_tokens=stats.proposed_tokens,
        accepted_tokens=stats.accepted_tokens,
        branch_accepted_tokens=stats.branch_accepted_tokens,
        acceptance_length_counts=tuple(lengths[i] for i in range(num_lengths)),
    )
