"""Which worker already holds which prompt blocks: the locality index and block hashing.

The Redis-backed index lives in ``cluster/``; it has the same ``longest_prefix`` method and
answers in one round trip. ``InProcessLocalityIndex`` serves tests and one-process setups.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Sequence
from typing import Protocol

from pdserve.engine.kv_cache.hashing import BlockHash, block_hashes, make_extra_keys
from pdserve.engine.kv_cache.tiers import KVTier
from pdserve.router.policies.types import PrefixHit


class PromptBlockHasher(Protocol):
    """Chained hashes of a prompt's full blocks, the same function the workers use.

    Bound to the model id (and LoRA name / cache salt) and block size by whoever builds it;
    ``engine_prompt_hasher`` binds the engine's own.
    """

    def __call__(self, token_ids: Sequence[int]) -> Sequence[BlockHash]: ...


class _EngineHasher:
    __slots__ = ("_block_size", "_extra_keys")

    def __init__(self, block_size: int, extra_keys: tuple[str, ...]) -> None:
        self._block_size = block_size
        self._extra_keys = extra_keys

    def __call__(self, token_ids: Sequence[int]) -> Sequence[BlockHash]:
        return block_hashes(token_ids, self._block_size, self._extra_keys)


def engine_prompt_hasher(
    model_id: str,
    block_size: int = 16,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> PromptBlockHasher:
    """pdserve.engine.kv_cache's block hashes with the workers' extra keys (model id must match)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return _EngineHasher(block_size, make_extra_keys(model_id, lora_name, cache_salt))


class LocalityIndex(Protocol):
    """Longest cached prefix per worker, and where its blocks live."""

    def longest_prefix(
        self, block_hashes: Sequence[BlockHash], worker_ids: Sequence[str]
    ) -> dict[str, PrefixHit] | Awaitable[dict[str, PrefixHit]]:
        """For each worker id, how many leading ``block_hashes`` that worker holds (and how
        many of those below its pool); now, or as an awaitable
        (``router/state/batched_lookups.py``)."""
        ...


class InProcessLocalityIndex:
    """Dicts of hash -> tier per worker, fed with the workers' stored / removed / cleared KV
    events."""

    def __init__(self) -> None:
        self._blocks: dict[str, dict[BlockHash, KVTier]] = {}

    def stored(
        self, worker_id: str, block_hashes: Iterable[BlockHash], tier: KVTier = KVTier.POOL
    ) -> None:
        self._blocks.setdefault(worker_id, {}).update(dict.fromkeys(block_hashes, tier))

    def removed(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        held = self._blocks.get(worker_id, {})
        for block_hash in block_hashes:
            held.pop(block_hash, None)

    def cleared(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)

    def longest_prefix(
        self, block_hashes: Sequence[BlockHash], worker_ids: Sequence[str]
    ) -> dict[str, PrefixHit]:
        return {w: _leading_hit(block_hashes, self._blocks.get(w, {})) for w in worker_ids}


def _leading_hit(block_hashes: Sequence[BlockHash], held: dict[BlockHash, KVTier]) -> PrefixHit:
    # A chained hash covers the whole prefix, so the first miss ends the cached prefix.
    tiers = []
    for block_hash in block_hashes:
        tier = held.get(block_hash)
        if tier is None:
            break
        tiers.append(tier)
    return PrefixHit(len(tiers), tiers.count(KVTier.HOST), tiers.count(KVTier.DISK))
