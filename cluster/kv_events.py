"""KV-cache events that workers publish to the locality index (pure: no Redis here).

Each event carries the worker's incarnation ``epoch`` and a per-incarnation ``seq`` that
starts at 1 and grows by one per event, so the index can tell a restart (new epoch) from a
lost event (gap in seq). A ``KvSnapshot`` replaces everything the index holds for the worker;
workers send one when asked (gap, lease lost, Redis restarted).

Block hashes are opaque to the index: 64-bit ints or 8-byte strings
(see :func:`pdserve.proto.redis_keys.block_hash_bytes`; the index checks them when it packs them).
Each held block has a tier (:class:`KVTier`: the pool, host memory or disk), so the router can
weigh a hit by what loading it costs; a block changing tier is stored again with the new one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.engine.kv_cache.tiers import KVTier
from pdserve.proto.redis_keys import check_worker_id

BlockHash = int | bytes


@dataclass(slots=True, frozen=True)
class KvStored:
    """The worker now holds these blocks in ``tier`` (wherever it held them before)."""

    worker_id: str
    epoch: int
    seq: int
    block_hashes: tuple[BlockHash, ...]
    tier: KVTier = KVTier.POOL


@dataclass(slots=True, frozen=True)
class KvRemoved:
    """The worker holds these blocks nowhere any more."""

    worker_id: str
    epoch: int
    seq: int
    block_hashes: tuple[BlockHash, ...]


@dataclass(slots=True, frozen=True)
class KvCleared:
    """The worker dropped its whole cache."""

    worker_id: str
    epoch: int
    seq: int


@dataclass(slots=True, frozen=True)
class KvSnapshot:
    """Everything the worker holds right after event ``seq`` (this one) was numbered:
    ``block_hashes[i]`` in ``tiers[i]``; no tiers = all in the pool."""

    worker_id: str
    epoch: int
    seq: int
    block_hashes: tuple[BlockHash, ...]
    tiers: tuple[KVTier, ...] = ()


KvEvent = KvStored | KvRemoved | KvCleared | KvSnapshot


def validate_event(event: KvEvent) -> None:
    """Raise ValueError if ``event`` has a bad worker id, epoch or seq."""
    check_worker_id(event.worker_id)
    if event.epoch <= 0 or event.seq <= 0:
        raise ValueError(
            f"epoch and seq must be > 0, got epoch={event.epoch} seq={event.seq} "
            f"from worker {event.worker_id!r}"
        )
    if isinstance(event, KvSnapshot) and len(event.tiers) not in (0, len(event.block_hashes)):
        raise ValueError(
            f"snapshot of worker {event.worker_id!r} has {len(event.block_hashes)} block "
            f"hashes but {len(event.tiers)} tiers; give one tier per hash, or none"
        )


def block_tiers(event: KvStored | KvSnapshot) -> tuple[KVTier, ...]:
    """The tier of each of the event's blocks."""
    if isinstance(event, KvStored):
        return (event.tier,) * len(event.block_hashes)
    return event.tiers or (KVTier.POOL,) * len(event.block_hashes)


class KvEventSequencer:
    """Worker-side numbering of events for one incarnation (``epoch``); not thread-safe."""

    def __init__(self, worker_id: str, epoch: int) -> None:
        self.worker_id = check_worker_id(worker_id)
        if epoch <= 0:
            raise ValueError(f"epoch must be > 0, got {epoch}")
        self.epoch = epoch
        self.last_seq = 0

    def _next(self) -> int:
        self.last_seq += 1
        return self.last_seq

    def stored(self, block_hashes: Iterable[BlockHash], tier: KVTier = KVTier.POOL) -> KvStored:
        return KvStored(self.worker_id, self.epoch, self._next(), tuple(block_hashes), tier)

    def removed(self, block_hashes: Iterable[BlockHash]) -> KvRemoved:
        return KvRemoved(self.worker_id, self.epoch, self._next(), tuple(block_hashes))

    def cleared(self) -> KvCleared:
        return KvCleared(self.worker_id, self.epoch, self._next())

    def snapshot(
        self, block_hashes: Iterable[BlockHash], tiers: Iterable[KVTier] = ()
    ) -> KvSnapshot:
        seq = self._next()
        return KvSnapshot(self.worker_id, self.epoch, seq, tuple(block_hashes), tuple(tiers))
