"""A worker engine's counters at one moment, as GetStats and the cluster agent read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


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
    )
