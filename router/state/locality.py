"""Which worker already holds which prompt blocks: the locality index and block hashing.

The Redis-backed index lives in ``cluster/``; it has the same ``longest_prefix`` method and
answers in one round trip. ``InProcessLocalityIndex`` serves tests and one-process setups.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Sequence
from typing import Protocol

from pdserve.engine.kv_cache.hashing import BlockHash, block_hashes, make_extra_keys


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
    """Longest cached prefix per worker."""

    def longest_prefix(
        self, block_hashes: Sequence[BlockHash], worker_ids: Sequence[str]
    ) -> dict[str, int] | Awaitable[dict[str, int]]:
        """For each worker id, how many leading ``block_hashes`` that worker holds; now, or
        as an awaitable (``router/state/batched_lookups.py``)."""
        ...


class InProcessLocalityIndex:
    """A dict of sets, fed with the workers' stored / removed / cleared KV events."""

    def __init__(self) -> None:
        self._blocks: dict[str, set[BlockHash]] = {}

    def stored(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        self._blocks.setdefault(worker_id, set()).update(block_hashes)

    def removed(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        self._blocks.get(worker_id, set()).difference_update(block_hashes)

    def cleared(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)

    def longest_prefix(
        self, block_hashes: Sequence[BlockHash], worker_ids: Sequence[str]
    ) -> dict[str, int]:
        return {w: _leading_hits(block_hashes, self._blocks.get(w, set())) for w in worker_ids}


def _leading_hits(block_hashes: Sequence[BlockHash], held: set[BlockHash]) -> int:
    # A chained hash covers the whole prefix, so the first miss ends the cached prefix.
    for i, block_hash in enumerate(block_hashes):
        if block_hash not in held:
            return i
    return len(block_hashes)
