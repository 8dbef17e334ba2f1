"""KV-cache events that workers publish to the locality index (pure: no Redis here).

Each event carries the worker's incarnation ``epoch`` and a per-incarnation ``seq`` that
starts at 1 and grows by one per event, so the index can tell a restart (new epoch) from a
lost event (gap in seq). A ``KvSnapshot`` replaces everything the index holds for the worker;
workers send one when asked (gap, lease lost, Redis restarted).

Block hashes are opaque to the index: 64-bit ints or 8-byte strings
(see :func:`pdserve.proto.redis_keys.block_hash_bytes`; the index checks them when it packs them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.proto.redis_keys import check_worker_id

BlockHash = int | bytes


@dataclass(slots=True, frozen=True)
class KvStored:
    """The worker now holds these blocks."""

    worker_id: str
    epoch: int
    seq: int
    block_hashes: tuple[BlockHash, ...]


@dataclass(slots=True, frozen=True)
class KvRemoved:
    """The worker evicted these blocks."""

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
    """Everything the worker holds right after event ``seq`` (this one) was numbered."""

    worker_id: str
    epoch: int
    seq: int
    block_hashes: tuple[BlockHash, ...]


KvEvent = KvStored | KvRemoved | KvCleared | KvSnapshot


def validate_event(event: KvEvent) -> None:
    """Raise ValueError if ``event`` has a bad worker id, epoch or seq."""
    check_worker_id(event.worker_id)
    if event.epoch <= 0 or event.seq <= 0:
        raise ValueError(
            f"epoch and seq must be > 0, got epoch={event.epoch} seq={event.seq} "
            f"from worker {event.worker_id!r}"
        )


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

    def stored(self, block_hashes: Iterable[BlockHash]) -> KvStored:
        return KvStored(self.worker_id, self.epoch, self._next(), tuple(block_hashes))

    def removed(self, block_hashes: Iterable[BlockHash]) -> KvRemoved:
        return KvRemoved(self.worker_id, self.epoch, self._next(), tuple(block_hashes))

    def cleared(self) -> KvCleared:
        return KvCleared(self.worker_id, self.epoch, self._next())

    def snapshot(self, block_hashes: Iterable[BlockHash]) -> KvSnapshot:
        return KvSnapshot(self.worker_id, self.epoch, self._next(), tuple(block_hashes))
