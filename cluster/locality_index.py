"""KV-cache locality index in Redis: which workers hold which blocks, and prefix lookups.

Each indexed worker owns a small integer *slot*. Per block hash the index keeps a bitmap
STRING (bit ``slot`` set <=> that worker holds the block): the set of holders, in a form that
one MGET can fetch for a whole prompt. Per worker a reverse SET of its block hashes lets all
of a worker's entries go at once (new epoch, ``cleared``, snapshot, lapsed lease)::

    idx:bits:<h0>  = 1 0 1 1 0 ...     slot 0 (w-a), 2 (w-c) and 3 (w-d) hold block h0
    idx:bits:<h1>  = 1 0 0 1 0 ...     w-a and w-d also hold h1
    idx:wblk:w-a   = {h0, h1, ...}

Every mutation and the lookup are Lua scripts: a batch of events is one atomic EVALSHA, and
:meth:`LocalityIndex.longest_prefix` is one EVALSHA for all candidates.

Event rules, per worker (state = epoch, last applied seq, awaiting-snapshot flag):

- the event's epoch must be the worker's registered epoch (else STALE_EPOCH/NOT_REGISTERED);
- a newer epoch than the state's drops all old entries and expects seq 1 next;
- seq <= last applied: DUPLICATE (ignored); seq > last + 1: GAP -> awaiting snapshot, and all
  deltas are ignored (AWAITING_SNAPSHOT) until a ``KvSnapshot`` with a higher seq arrives.

Lookups count a worker only while its lease is live, its registered epoch equals the index's
epoch for it and no snapshot is awaited: its entries are then complete and current.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from string import Template

import redis

from cluster.kv_events import KvCleared, KvEvent, KvRemoved, KvSnapshot, KvStored, validate_event
from cluster.redis_keys import (
    LUA_NAMESPACES,
    RedisKeys,
    check_worker_id,
    pack_block_hashes,
    unpack_block_hash,
)


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

# Shared by all scripts: key namespaces under ARGV[1] (the prefix) and entry removal.
_PRELUDE = """
local p = ARGV[1]
local WNS, BITS = p .. '$worker_ns', p .. '$block_bits_ns'
local RNS, SNS, IWS = p .. '$worker_blocks_ns', p .. '$index_state_ns', p .. '$index_workers_set'
local SLOTS = p .. '$index_slots'
local function clear_bit(h, slot)
  local key = BITS .. h
  redis.call('SETBIT', key, slot, 0)
  if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
end
local function drop_entries(w, slot)
  local rkey = RNS .. w
  for _, h in ipairs(redis.call('SMEMBERS', rkey)) do clear_bit(h, slot) end
  redis.call('DEL', rkey)
end
"""

# ARGV: prefix, then per event: worker_id, epoch, seq, kind (S R C P), packed 8-byte hashes.
_APPLY_LUA = """
local function change_blocks(add, w, slot, packed)
  local rkey = RNS .. w
  for j = 1, #packed, 8 do
    local h = string.sub(packed, j, j + 7)
    if add then
      if redis.call('SADD', rkey, h) == 1 then redis.call('SETBIT', BITS .. h, slot, 1) end
    elseif redis.call('SREM', rkey, h) == 1 then
      clear_bit(h, slot)
    end
  end
end
local function new_slot(w)
  local i = 0
  while redis.call('HSETNX', SLOTS, i, w) == 0 do i = i + 1 end
  return tostring(i)
end
local function apply_one(w, e, s, kind, packed)
  local reg = redis.call('HGET', WNS .. w, 'epoch')
  local en, sn = tonumber(e), tonumber(s)
  if not reg or tonumber(reg) < en then return 5 end
  if tonumber(reg) > en then return 2 end
  local skey = SNS .. w
  local st = redis.call('HMGET', skey, 'epoch', 'seq', 'snap', 'slot')
  if st[1] and tonumber(st[1]) > en then return 2 end
  local slot = st[4] or new_slot(w)
  if st[1] ~= e then
    if st[1] then drop_entries(w, slot) end
    redis.call('HSET', skey, 'epoch', e, 'seq', '0', 'snap', '0', 'slot', slot)
    redis.call('SADD', IWS, w)
    st = {e, '0', '0', slot}
  end
  local last = tonumber(st[2])
  if kind == 'P' then
    if sn <= last then return 1 end
    drop_entries(w, slot)
    change_blocks(true, w, slot, packed)
    redis.call('HSET', skey, 'seq', s, 'snap', '0')
    return 0
  end
  if st[3] == '1' then return 4 end
  if sn <= last then return 1 end
  if sn > last + 1 then
    redis.call('HSET', skey, 'snap', '1')
    return 3
  end
  if kind == 'C' then drop_entries(w, slot) else change_blocks(kind == 'S', w, slot, packed) end
  redis.call('HSET', skey, 'seq', s)
  return 0
end
local out = {}
for i = 2, #ARGV, 5 do
  out[#out + 1] = apply_one(ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4])
end
return out
"""

# ARGV: prefix, number of workers W, W worker ids, packed 8-byte hashes in prompt order.
# Returns W counts of leading blocks held. Candidates are grouped by 32-bit word of the
# bitmaps; per block one 4-byte read per group ANDs away the workers whose run just ended.
# Blocks are fetched 64 at a time with MGET, stopping once no candidate is left.
_LONGEST_PREFIX_LUA = """
local nw = tonumber(ARGV[2])
local packed = ARGV[3 + nw]
local nb = #packed / 8
local counts, by_word, groups = {}, {}, {}
for k = 1, nw do
  counts[k] = 0
  local w = ARGV[2 + k]
  local reg = redis.call('HGET', WNS .. w, 'epoch')
  local st = redis.call('HMGET', SNS .. w, 'epoch', 'snap', 'slot')
  if reg and st[1] == reg and st[2] == '0' then
    local slot = tonumber(st[3])
    local wi = math.floor(slot / 32)
    local g = by_word[wi]
    if not g then
      g = {first = 4 * wi + 1, alive = 0, members = {}}
      by_word[wi] = g
      groups[#groups + 1] = g
    end
    local m = bit.lshift(1, 31 - slot % 32)
    g.alive = bit.bor(g.alive, m)
    g.members[#g.members + 1] = {k, m}
  end
end
local live, done = #groups, 0
while live > 0 and done < nb do
  local stop = math.min(nb, done + 64)
  local keys = {}
  for b = done + 1, stop do keys[#keys + 1] = BITS .. string.sub(packed, 8 * b - 7, 8 * b) end
  local vals = redis.call('MGET', unpack(keys))
  for j = 1, #vals do
    local v = vals[j]
    for _, g in ipairs(groups) do
      if g.alive ~= 0 then
        local word = 0
        if v then
          local b1, b2, b3, b4 = string.byte(v, g.first, g.first + 3)
          word = (((b1 or 0) * 256 + (b2 or 0)) * 256 + (b3 or 0)) * 256 + (b4 or 0)
        end
        local now = bit.band(g.alive, word)
        if now ~= g.alive then
          for _, km in ipairs(g.members) do
            if bit.band(g.alive, km[2]) ~= 0 and bit.band(now, km[2]) == 0 then
              counts[km[1]] = done + j - 1
            end
          end
          g.alive = now
          if now == 0 then live = live - 1 end
        end
      end
    end
    if live == 0 then break end
  end
  done = stop
end
for _, g in ipairs(groups) do
  for _, km in ipairs(g.members) do
    if bit.band(g.alive, km[2]) ~= 0 then counts[km[1]] = nb end
  end
end
return counts
"""

# ARGV: prefix. Drops entries, state and slot of workers whose lease lapsed or whose
# registered epoch is no longer the indexed one; returns their ids.
_SWEEP_LUA = """
local dropped = {}
for _, w in ipairs(redis.call('SMEMBERS', IWS)) do
  local reg = redis.call('HGET', WNS .. w, 'epoch')
  local st = redis.call('HMGET', SNS .. w, 'epoch', 'slot')
  if not reg or reg ~= st[1] then
    if st[2] then
      drop_entries(w, st[2])
      redis.call('HDEL', SLOTS, st[2])
    end
    redis.call('DEL', SNS .. w)
    redis.call('SREM', IWS, w)
    dropped[#dropped + 1] = w
  end
end
return dropped
"""


def _script(body: str) -> str:
    return Template(_PRELUDE).substitute(LUA_NAMESPACES) + body


def encode_events(batch: Sequence[KvEvent]) -> list[str | bytes]:
    """The flat ARGV tail of the apply script for ``batch`` (validated)."""
    args: list[str | bytes] = []
    for event in batch:
        validate_event(event)
        hashes = () if isinstance(event, KvCleared) else event.block_hashes
        kind = _KIND_CODES[type(event)]
        args += [event.worker_id, str(event.epoch), str(event.seq), kind]
        args.append(pack_block_hashes(hashes))
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
        self._apply = client.register_script(_script(_APPLY_LUA))
        self._lookup = client.register_script(_script(_LONGEST_PREFIX_LUA))
        self._sweep = client.register_script(_script(_SWEEP_LUA))
        for script in (self._apply, self._lookup, self._sweep):
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
    ) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` that each candidate holds, in one round trip.

        Workers without a live lease, or whose entries are not current (new epoch not yet
        published, snapshot awaited), count 0.
        """
        ids = list(dict.fromkeys(check_worker_id(w) for w in worker_ids))
        packed = pack_block_hashes(block_hashes)
        if not ids or not packed:
            return dict.fromkeys(ids, 0)
        counts = self._lookup(args=[self._keys.prefix, len(ids), *ids, packed])
        return {w: int(c) for w, c in zip(ids, counts, strict=True)}

    def sweep(self) -> list[str]:
        """Drop the entries of workers whose lease lapsed or epoch changed; return their ids."""
        return sorted(_as_str(w) for w in self._sweep(args=[self._keys.prefix]))

    def blocks_of(self, worker_id: str) -> set[int]:
        """Block hashes (as ints) indexed for ``worker_id``: for tests and debugging."""
        members = self._client.smembers(self._keys.worker_blocks(check_worker_id(worker_id)))
        return {unpack_block_hash(_as_bytes(m)) for m in members}

    def holders(self, block_hash: int | bytes) -> set[str]:
        """Ids indexed as holding ``block_hash``, live or not: for tests and debugging."""
        bitmap = _as_bytes(self._client.get(self._keys.block_bits(block_hash)) or b"")
        slots = self._client.hgetall(self._keys.index_slots)
        held = set()
        for slot, worker_id in slots.items():
            byte, bit = divmod(int(slot), 8)
            if byte < len(bitmap) and bitmap[byte] & (0x80 >> bit):
                held.add(_as_str(worker_id))
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
