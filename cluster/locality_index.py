"""KV-cache locality index in Redis: which workers hold which blocks, and prefix lookups.

Each indexed worker owns a small integer *slot*. Per block hash the index keeps a STRING of
2-bit codes, one per slot (0 = not held, 1 = in the pool, 2 = in host memory, 3 = on disk):
the holders and where each keeps the block, in a form that one MGET can fetch for a whole
prompt. Per worker a reverse SET of its block hashes lets all of a worker's entries go at
once (new epoch, ``cleared``, snapshot, lapsed lease)::

    slot:           0  1  2  3  4 ...
    idx:bits:<h0> = 01 00 10 11 00 ...  w-a (slot 0) holds h0 in its pool, w-c in host
                                        memory, w-d on disk
    idx:bits:<h1> = 01 00 00 01 00 ...  w-a and w-d hold h1 in their pools
    idx:wblk:w-a  = {h0, h1, ...}

Every mutation and the lookup are Lua scripts (cluster/locality_scripts.py): a batch of events
is one atomic EVALSHA, and :meth:`LocalityIndex.longest_prefix` is one EVALSHA for all
candidates.

Event rules, per worker (state = epoch, last applied seq, awaiting-snapshot flag):

- the event's epoch must be the worker's registered epoch (else STALE_EPOCH/NOT_REGISTERED);
- a newer epoch than the state's drops all old entries and expects seq 1 next;
- seq <= last applied: DUPLICATE (ignored); seq > last + 1: GAP -> awaiting snapshot, and all
  deltas are ignored (AWAITING_SNAPSHOT) until a ``KvSnapshot`` with a higher seq arrives.

Lookups count a worker only while its lease is live, its registered epoch equals the index's
epoch for it and no snapshot is awaited: its entries are then complete and current. A lookup
answers per worker a :class:`PrefixHit`: the leading blocks held, and how many of those live
in host memory or on disk.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import redis

from pdserve.cluster.kv_events import (
    KvCleared,
    KvEvent,
    KvRemoved,
    KvSnapshot,
    KvStored,
    block_tiers,
    validate_event,
)
from pdserve.cluster.locality_scripts import APPLY_SCRIPT, LONGEST_PREFIX_SCRIPT, SWEEP_SCRIPT
from pdserve.engine.kv_cache.tiers import KVTier
from pdserve.proto.redis_keys import (
    RedisKeys,
    check_worker_id,
    pack_block_hashes,
    unpack_block_hash,
)
from pdserve.router.policies.types import PrefixHit


class ApplyStatus(IntEnum):
    APPLIED = 0
    DUPLICATE = 1
    STALE_EPOCH = 2
    GAP = 3  # the worker must send a snapshot
    AWAITING_SNAPSHOT = 4  # ignored; the worker still owes a snapshot
    NOT_REGISTERED = 5  # no live lease for this (worker, epoch): register first


@dataclass(slots=True, frozen=True)
class ApplyResult:
    """Per-event statuses (in batch order) and the workers that must publish a snapshot."""

    statuses: tuple[ApplyStatus, ...]
    snapshot_requests: frozenset[str]


_KIND_CODES: dict[type, str] = {KvStored: "S", KvRemoved: "R", KvCleared: "C", KvSnapshot: "P"}


def encode_events(batch: Sequence[KvEvent]) -> list[str | bytes]:
    """The flat ARGV tail of the apply script for ``batch`` (validated)."""
    args: list[str | bytes] = []
    for event in batch:
        validate_event(event)
        hashes = () if isinstance(event, KvCleared) else event.block_hashes
        codes = bytes(block_tiers(event)) if isinstance(event, KvStored | KvSnapshot) else b""
        kind = _KIND_CODES[type(event)]
        args += [event.worker_id, str(event.epoch), str(event.seq), kind]
        args += [pack_block_hashes(hashes), codes]
    return args


def _outstanding_snapshots(
    batch: Sequence[KvEvent], statuses: Sequence[ApplyStatus]
) -> frozenset[str]:
    # A worker owes a snapshot after a gap unless a later snapshot in this batch paid it.
    owing: set[str] = set()
    for event, status in zip(batch, statuses, strict=True):
        if status in (ApplyStatus.GAP, ApplyStatus.AWAITING_SNAPSHOT):
            owing.add(event.worker_id)
        elif status == ApplyStatus.APPLIED and isinstance(event, KvSnapshot):
            owing.discard(event.worker_id)
    return frozenset(owing)


def _as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _as_bytes(value: bytes | str) -> bytes:
    # The client is checked to have decode_responses=False, so this is only for the types.
    assert isinstance(value, bytes), f"expected bytes from Redis, got {type(value).__name__}"
    return value


# KEYS: the worker's block set, then the other workers' sets. Counts on the server, so a
# worker's thousands of 8-byte members never cross the network.
_UNIQUE_BLOCKS_LUA = "return #redis.call('SDIFF', unpack(KEYS))"


class LocalityIndex:
    """The locality index in one Redis, under ``keys.prefix``. Scripts are loaded eagerly so
    that the first lookup already costs a single round trip."""

    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        if client.get_encoder().decode_responses:
            raise ValueError(
                "LocalityIndex needs a client with decode_responses=False: block hashes and "
                "bitmaps are binary"
            )
        self._client = client
        self._keys = keys
        self._apply = client.register_script(APPLY_SCRIPT)
        self._lookup = client.register_script(LONGEST_PREFIX_SCRIPT)
        self._sweep = client.register_script(SWEEP_SCRIPT)
        self._unique = client.register_script(_UNIQUE_BLOCKS_LUA)
        for script in (self._apply, self._lookup, self._sweep, self._unique):
            client.script_load(script.script)
        self._run_id = self._adopt_run_id()

    def apply(self, batch: Sequence[KvEvent]) -> ApplyResult:
        """Apply a batch of events (any workers, any order) atomically, in one round trip."""
        if not batch:
            return ApplyResult((), frozenset())
        codes = self._apply(args=[self._keys.prefix, *encode_events(batch)])
        statuses = tuple(ApplyStatus(int(c)) for c in codes)
        return ApplyResult(statuses, _outstanding_snapshots(batch, statuses))

    def longest_prefix(
        self, block_hashes: Sequence[int | bytes], worker_ids: Sequence[str]
    ) -> dict[str, PrefixHit]:
        """Leading blocks of ``block_hashes`` that each candidate holds, and in which tiers,
        in one round trip.

        Workers without a live lease, or whose entries are not current (new epoch not yet
        published, snapshot awaited), hold nothing.
        """
        return self.longest_prefix_many([(block_hashes, worker_ids)])[0]

    def longest_prefix_many(
        self, queries: Sequence[tuple[Sequence[int | bytes], Sequence[str]]]
    ) -> list[dict[str, PrefixHit]]:
        """``longest_prefix`` of each (block hashes, worker ids) query, all in one round trip
        (one pipeline); the router batches concurrent requests' lookups this way."""
        prepared = []
        for block_hashes, worker_ids in queries:
            ids = list(dict.fromkeys(check_worker_id(w) for w in worker_ids))
            prepared.append((ids, pack_block_hashes(block_hashes)))
        lookups = [(ids, packed) for ids, packed in prepared if ids and packed]
        try:
            replies = iter(self._run_lookups(lookups))
        except redis.exceptions.NoScriptError:  # Redis restarted and lost its script cache
            self._client.script_load(self._lookup.script)
            replies = iter(self._run_lookups(lookups))
        answers = []
        for ids, packed in prepared:
            counts = next(replies) if ids and packed else [0] * (3 * len(ids))
            answers.append(
                {w: PrefixHit(*map(int, counts[3 * i : 3 * i + 3])) for i, w in enumerate(ids)}
            )
        return answers

    def _run_lookups(self, lookups: Sequence[tuple[list[str], bytes]]) -> list[list[int]]:
        """EVALSHA straight into the pipeline: a ``Script`` there would first ask whether the
        script exists, a second round trip on every call."""
        if not lookups:
            return []
        pipe = self._client.pipeline(transaction=False)
        for ids, packed in lookups:
            pipe.evalsha(self._lookup.sha, 0, self._keys.prefix, len(ids), *ids, packed)
        return list(pipe.execute())

    def sweep(self) -> list[str]:
        """Drop the entries of workers whose lease lapsed or epoch changed; return their ids."""
        return sorted(_as_str(w) for w in self._sweep(args=[self._keys.prefix]))

    def unique_blocks(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """For each of ``worker_ids``: how many of its indexed blocks none of the others holds
        (what the cluster would lose by removing it), in one round trip."""
        ids = list(dict.fromkeys(check_worker_id(w) for w in worker_ids))
        sets = {w: self._keys.worker_blocks(w) for w in ids}
        pipe = self._client.pipeline(transaction=False)
        for w in ids:
            others = [key for other, key in sets.items() if other != w]
            self._unique(keys=[sets[w], *others], client=pipe)
        return {w: int(n) for w, n in zip(ids, pipe.execute(), strict=True)}

    def blocks_of(self, worker_id: str) -> set[int]:
        """Block hashes (as ints) indexed for ``worker_id``: for tests and debugging."""
        members = self._client.smembers(self._keys.worker_blocks(check_worker_id(worker_id)))
        return {unpack_block_hash(_as_bytes(m)) for m in members}

    def holders(self, block_hash: int | bytes) -> dict[str, KVTier]:
        """Ids indexed as holding ``block_hash``, live or not, with the tier each keeps it
        in: for tests and debugging."""
        codes = _as_bytes(self._client.get(self._keys.block_bits(block_hash)) or b"")
        slots = self._client.hgetall(self._keys.index_slots)
        held = {}
        for slot, worker_id in slots.items():
            byte, pair = divmod(int(slot), 4)  # four 2-bit codes per byte, first one highest
            code = (codes[byte] >> (6 - 2 * pair)) & 3 if byte < len(codes) else 0
            if code:
                held[_as_str(worker_id)] = KVTier(code)
        return held

    def _adopt_run_id(self) -> str:
        self._client.set(self._keys.run_id, uuid.uuid4().hex, nx=True)
        return _as_str(self._client.get(self._keys.run_id) or b"")

    def check_restart(self) -> bool:
        """True (once) if Redis lost our keys since the last check: restarted or flushed.

        Everything is then gone, registrations included, so every worker's next heartbeat
        returns LEASE_LOST and the worker re-registers and publishes a snapshot: that is the
        rebuild. The caller may log, and expect lookups to be cold until then.
        """
        current = self._client.get(self._keys.run_id)
        if current is not None and _as_str(current) == self._run_id:
            return False
        self._run_id = self._adopt_run_id()
        return True
