"""Per-sequence block tables over a :class:`BlockPool`, with prefix caching and copy-on-write.

Copy-on-write pairs queued by ``allocate`` are taken with
:meth:`KVCacheManager.take_block_copies`; the runner must apply them in order before the
forward pass (a block freed by one copy may be the destination of a later one).
See ``block_table.py`` for the layout of one table, ``prefix.py`` for prefix lookups and the
result types (``PrefixMatch``, ``ImportReservation``).

With tiers below the pool (``tiers``), a prefix lookup continues past the pool's cached
blocks into them; ``allocate`` gives such blocks fresh pool blocks and queues
``(block_id, block_hash)`` loads, taken with :meth:`KVCacheManager.take_block_loads`, that
the engine applies before the forward pass (after saving the blocks it evicted, taken with
:meth:`KVCacheManager.take_evictions`: a load may land in a just-evicted block). Then
:meth:`KVCacheManager.publish_tier_moves` turns what moved between the tiers into KV events,
so the locality index knows where each block lives.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.kv_cache import tier_events
from pdserve.engine.kv_cache.block_pool import BlockPool
from pdserve.engine.kv_cache.block_table import SequenceBlocks
from pdserve.engine.kv_cache.events import CachedBlocks, KVCacheEvent
from pdserve.engine.kv_cache.hashing import BlockHash, BlockHasher, encode_extra_keys
from pdserve.engine.kv_cache.prefix import (
    ImportReservation,
    PrefixMatch,
    assert_match_current,
    match_prefix,
)
from pdserve.engine.kv_cache.tiers import LowerTiers

__all__ = ["ImportReservation", "KVCacheManager", "PrefixMatch"]


class KVCacheManager:
    """Block tables for all sequences of one worker. Pure bookkeeping: no tensors.

    Back-pressure is a return value: ``allocate`` and ``reserve_for_import`` return None when
    the pool is short of blocks, and then change nothing.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_keys: Sequence[str] = (),
        tiers: LowerTiers | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._tiers = tiers if enable_prefix_caching else None
        self._pool = BlockPool(num_blocks, keep_evictions=self._tiers is not None)
        self._block_size = block_size
        self._caching = enable_prefix_caching
        self._extra = encode_extra_keys(extra_keys)
        self._seqs: dict[str, SequenceBlocks] = {}
        self._copies: list[tuple[int, int]] = []
        self._loads: list[tuple[int, BlockHash]] = []
        self.prefix_hit_tokens = 0
        self.prefix_queried_tokens = 0

    # -- sizes and stats -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self._caching

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences (free cached blocks count as free)."""
        return self._pool.usage

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / max(1, self.prefix_queried_tokens)

    @property
    def pool(self) -> BlockPool:
        """The underlying pool (read it; mutate only through this manager)."""
        return self._pool

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: str) -> tuple[int, ...]:
        return tuple(self._state(seq_id).block_ids)

    # -- prefix lookup and allocation ------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest run of cached full blocks at the start of ``token_ids``, in the pool and
        then in the tiers below it.

        Never the whole sequence: at most ``len(token_ids) - 1`` tokens, rounded down to whole
        blocks, so the last token is always computed and yields logits. Changes nothing.
        """
        return self._match(token_ids, max(0, len(token_ids) - 1), self._tiers)

    def prefetch(self, token_ids: Sequence[int]) -> None:
        """A prompt arrived: let the tiers start reading the blocks of its prefix past the
        pool's (the lookup that admits it will want them). Changes nothing here."""
        if self._tiers is None:
            return
        hashes = BlockHasher(self._block_size, encoded_extra_keys=self._extra).update(token_ids)
        candidates = hashes[: max(0, len(token_ids) - 1) // self._block_size]
        in_pool = 0
        while in_pool < len(candidates) and self._pool.lookup(candidates[in_pool]) is not None:
            in_pool += 1
        self._tiers.prefetch(candidates[in_pool:])

    def allocate(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        prefix: PrefixMatch | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make the block table cover ``num_computed_tokens + num_new_tokens`` positions
        (plus ``num_lookahead_tokens`` slots for speculative tokens, never cached).

        ``token_ids`` are all the sequence's known tokens. On a sequence's first call,
        ``prefix`` (from :meth:`lookup_prefix` on the same tokens, just before) is adopted and
        ``num_computed_tokens`` must equal ``prefix.num_tokens``. Writing positions
        ``num_computed_tokens ..`` into shared blocks triggers copy-on-write. Returns the
        block table, or None (nothing changed) if the pool is short of blocks.
        """
        self._check_range(seq_id, token_ids, num_computed_tokens, num_new_tokens)
        state = self._seqs.get(seq_id)
        if state is None:
            if num_lookahead_tokens:
                raise ValueError(f"sequence {seq_id!r}: speculative slots need a running sequence")
            return self._allocate_first(
                seq_id, token_ids, num_computed_tokens, num_new_tokens, prefix or PrefixMatch()
            )
        if prefix is not None:
            raise ValueError(
                f"sequence {seq_id!r} already holds {len(state.block_ids)} blocks; "
                "pass a prefix only on its first allocate"
            )
        end = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_grow = max(0, self.num_blocks_for_tokens(end) - len(state.block_ids))
        shared = state.shared_write_indices(num_computed_tokens, end)
        fresh = self._pool.allocate(num_grow + len(shared))
        if fresh is None:
            return None
        self._copies += state.copy_on_write(shared, fresh[: len(shared)], num_computed_tokens)
        state.block_ids.extend(fresh[len(shared) :])
        state.commit(token_ids, num_computed_tokens)
        return list(state.block_ids)

    def commit_computed(
        self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Register the sequence's full blocks whose tokens are all computed (KV written)."""
        self._check_range(seq_id, token_ids, num_computed_tokens, 0)
        self._state(seq_id).commit(token_ids, num_computed_tokens)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Roll back to ``num_tokens`` positions: free the blocks past them (speculative slots
        of rejected tokens), to be reused first. The cached blocks stay (all are kept)."""
        state = self._state(seq_id)
        keep = self.num_blocks_for_tokens(num_tokens)
        assert state.num_cached <= keep, (
            f"truncating {seq_id!r} to {num_tokens} tokens would drop a cached block"
        )
        if keep < len(state.block_ids):
            dropped = state.block_ids[keep:]
            del state.block_ids[keep:]
            self._pool.free(reversed(dropped), reuse_first=True)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's whole block table (shared, ref_cnt + 1 each).

        The child's tokens must equal the parent's over the computed positions it keeps.
        """
        parent = self._state(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"cannot fork into {child_id!r}: it already holds blocks")
        self._pool.touch(parent.block_ids)
        hasher = parent.hasher.copy(parent.num_cached) if parent.hasher else None
        self._seqs[child_id] = self._new_state(list(parent.block_ids), hasher, parent.num_cached)

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks, last block first (so its tail is evicted first)."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            raise ValueError(f"free: sequence {seq_id!r} holds no blocks")
        self._pool.free(reversed(state.block_ids))

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write ``(src, dst)`` pairs queued since the last call, in order; clears."""
        copies, self._copies = self._copies, []
        return copies

    def take_block_loads(self) -> list[tuple[int, BlockHash]]:
        """Tier hits to load: ``(destination block, block hash)`` queued since the last call,
        in order; clears. Each block is already cached under its hash."""
        loads, self._loads = self._loads, []
        return loads

    def take_evictions(self) -> list[tuple[int, BlockHash]]:
        """``(block_id, hash)`` of cached blocks the pool reused since the last call (only
        with tiers): their KV is still in the block until the next step writes it."""
        return self._pool.take_evictions()

    # -- disaggregation hooks --------------------------------------------------------
    def reserve_for_import(
        self, seq_id: str, token_ids: Sequence[int], record_hits: bool = True
    ) -> ImportReservation | None:
        """Reserve blocks for all of ``token_ids`` whose KV another worker computed.

        Leading blocks already cached here, in the pool or a tier below it, are reused (and
        reported, so the sender skips them; tier hits are queued as loads like
        ``allocate``'s); the rest are fresh. Returns None (nothing changed) if blocks are
        short. After the transfer: :meth:`commit_import`, or :meth:`free` if it failed.

        ``record_hits``: count the reused blocks as prefix hits (a decode worker's import:
        the blocks nobody had to send); not for a peer fetch's reservation or the holder's
        hold on the blocks it sends, where the prefill that follows, if any, counts.
        """
        if not token_ids:
            raise ValueError(f"reserve_for_import({seq_id!r}): token_ids is empty")
        if seq_id in self._seqs:
            raise ValueError(f"reserve_for_import: sequence {seq_id!r} already holds blocks")
        match = self._match(token_ids, len(token_ids), self._tiers)
        state = self._adopt(seq_id, token_ids, match, len(token_ids), record_hits)
        if state is None:
            return None
        state.commit(token_ids, match.num_tokens)  # the tier hits are cached as they load
        state.import_token_ids = tuple(token_ids)
        num_local = len(match.block_ids) + match.num_tier_blocks
        return ImportReservation(seq_id, tuple(state.block_ids), num_local, match.num_tokens)

    def commit_import(self, seq_id: str) -> None:
        """The imported KV has landed: cache its full blocks. Idempotent."""
        state = self._state(seq_id)
        if state.import_token_ids is not None:
            tokens, state.import_token_ids = state.import_token_ids, None
            state.commit(tokens, len(tokens))

    # -- cluster index ---------------------------------------------------------------
    def drain_events(self) -> list[KVCacheEvent]:
        return self._pool.drain_events()

    def cached_block_hashes(self) -> tuple[BlockHash, ...]:
        """The hashes the pool caches (the tiers below it not included)."""
        return self._pool.cached_block_hashes()

    def cached_blocks(self) -> CachedBlocks:
        """Every hash this worker can serve, with the fastest tier holding it."""
        return tier_events.cached_blocks(self._pool, self._tiers)

    def reset_prefix_cache(self) -> None:
        """Forget the pool's cached hashes (``CacheCleared``); the tiers below keep theirs,
        stored again by the events right after it."""
        self._pool.reset_prefix_cache()
        if self._tiers is not None:
            below = tier_events.below_pool(self._tiers, set())
            for event in tier_events.stored_by_tier(below):
                self._pool.record(event)

    def publish_tier_moves(self) -> None:
        """Record the KV events of what moved between the tiers since the last call (see
        ``tier_events.tier_move_events``); call after the engine synced the tiers."""
        if self._tiers is not None:
            for event in tier_events.tier_move_events(self._pool, self._tiers):
                self._pool.record(event)

    # -- internals -------------------------------------------------------------------
    def _state(self, seq_id: str) -> SequenceBlocks:
        state = self._seqs.get(seq_id)
        if state is None:
            raise ValueError(f"sequence {seq_id!r} holds no blocks (never allocated or freed)")
        return state

    def _new_state(
        self, block_ids: list[int], hasher: BlockHasher | None, num_cached: int
    ) -> SequenceBlocks:
        return SequenceBlocks(self._pool, self._block_size, block_ids, hasher, num_cached)

    def _check_range(
        self, seq_id: str, token_ids: Sequence[int], num_computed: int, num_new: int
    ) -> None:
        if num_computed < 0 or num_new < 0 or num_computed + num_new > len(token_ids):
            raise ValueError(
                f"sequence {seq_id!r}: need 0 <= num_computed_tokens ({num_computed}) and "
                f"0 <= num_new_tokens ({num_new}) with their sum <= {len(token_ids)} tokens"
            )

    def _match(
        self, token_ids: Sequence[int], max_tokens: int, tiers: LowerTiers | None = None
    ) -> PrefixMatch:
        if not self._caching:
            return PrefixMatch()
        return match_prefix(self._pool, self._block_size, self._extra, token_ids, max_tokens, tiers)

    def _allocate_first(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed: int,
        num_new: int,
        prefix: PrefixMatch,
    ) -> list[int] | None:
        if num_computed != prefix.num_tokens:
            raise ValueError(
                f"sequence {seq_id!r}: first allocate needs num_computed_tokens "
                f"({num_computed}) == the prefix hit ({prefix.num_tokens} tokens)"
            )
        state = self._adopt(seq_id, token_ids, prefix, num_computed + num_new)
        if state is None:
            return None
        state.commit(token_ids, num_computed)
        return list(state.block_ids)

    def _adopt(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        prefix: PrefixMatch,
        num_tokens: int,
        record_hits: bool = True,
    ) -> SequenceBlocks | None:
        """New state: prefix blocks (touched) + fresh blocks up to ``num_tokens`` positions."""
        assert_match_current(self._pool, seq_id, prefix)
        num_fresh = max(0, self.num_blocks_for_tokens(num_tokens) - len(prefix.block_ids))
        num_revived = sum(1 for b in prefix.block_ids if self._pool.ref_count(b) == 0)
        if self._pool.num_free_blocks < num_fresh + num_revived:
            return None
        self._pool.touch(prefix.block_ids)
        fresh = self._pool.allocate(num_fresh)
        assert fresh is not None, f"{num_fresh} free blocks were counted but not allocated"
        self._loads += zip(fresh, prefix.tier_block_hashes, strict=False)
        hasher = None
        if self._caching:
            hasher = BlockHasher(
                self._block_size,
                encoded_extra_keys=self._extra,
                known_hashes=prefix.block_hashes,
            )
            if record_hits:
                self.prefix_queried_tokens += len(token_ids)
                self.prefix_hit_tokens += prefix.num_tokens
        state = self._new_state(list(prefix.block_ids) + fresh, hasher, len(prefix.block_ids))
        self._seqs[seq_id] = state
        return state
