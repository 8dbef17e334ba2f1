"""The locality index's Lua scripts: every mutation and the lookup run atomically inside
Redis, one EVALSHA each (see cluster/locality_index.py for the rules they implement and
docs/redis-schema.md for the keys).

Key namespaces are substituted from ``pdserve.proto.redis_keys.LUA_NAMESPACES`` (``$worker_ns``
...), so scripts and Python build the same names; the prefix itself comes in ``ARGV[1]``.
"""

from __future__ import annotations

from string import Template

from pdserve.proto.redis_keys import LUA_NAMESPACES

# Shared by all scripts: key namespaces under ARGV[1] (the prefix) and entry removal. A
# block's bitmap holds a 2-bit tier code per slot (BITFIELD u2 at #slot): 0 not held,
# 1 pool, 2 host memory, 3 disk (engine.kv_cache.tiers.KVTier).
_PRELUDE = """
local p = ARGV[1]
local WNS, BITS = p .. '$worker_ns', p .. '$block_bits_ns'
local RNS, SNS, IWS = p .. '$worker_blocks_ns', p .. '$index_state_ns', p .. '$index_workers_set'
local SLOTS = p .. '$index_slots'
local function clear_code(h, slot)
  local key = BITS .. h
  redis.call('BITFIELD', key, 'SET', 'u2', '#' .. slot, 0)
  if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
end
local function drop_entries(w, slot)
  local rkey = RNS .. w
  for _, h in ipairs(redis.call('SMEMBERS', rkey)) do clear_code(h, slot) end
  redis.call('DEL', rkey)
end
"""

# ARGV: prefix, then per event: worker_id, epoch, seq, kind (S R C P), packed 8-byte hashes,
# tier codes (one byte per hash for S and P, empty for R and C).
# Returns one code per event: the values of locality_index.ApplyStatus (0 = APPLIED ...).
_APPLY_LUA = """
local function store_blocks(w, slot, packed, codes)
  local rkey = RNS .. w
  for j = 1, #packed / 8 do
    local h = string.sub(packed, 8 * j - 7, 8 * j)
    redis.call('SADD', rkey, h)
    redis.call('BITFIELD', BITS .. h, 'SET', 'u2', '#' .. slot, string.byte(codes, j))
  end
end
local function remove_blocks(w, slot, packed)
  local rkey = RNS .. w
  for j = 1, #packed, 8 do
    local h = string.sub(packed, j, j + 7)
    if redis.call('SREM', rkey, h) == 1 then clear_code(h, slot) end
  end
end
local function new_slot(w)
  local i = 0
  while redis.call('HSETNX', SLOTS, i, w) == 0 do i = i + 1 end
  return tostring(i)
end
local function apply_one(w, e, s, kind, packed, codes)
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
    store_blocks(w, slot, packed, codes)
    redis.call('HSET', skey, 'seq', s, 'snap', '0')
    return 0
  end
  if st[3] == '1' then return 4 end
  if sn <= last then return 1 end
  if sn > last + 1 then
    redis.call('HSET', skey, 'snap', '1')
    return 3
  end
  if kind == 'C' then
    drop_entries(w, slot)
  elseif kind == 'S' then
    store_blocks(w, slot, packed, codes)
  else
    remove_blocks(w, slot, packed)
  end
  redis.call('HSET', skey, 'seq', s)
  return 0
end
local out = {}
for i = 2, #ARGV, 6 do
  out[#out + 1] = apply_one(unpack(ARGV, i, i + 5))
end
return out
"""

# ARGV: prefix, number of workers W, W worker ids, packed 8-byte hashes in prompt order.
# Returns 3 numbers per worker: leading blocks held, and of those how many live in host
# memory and on disk. Candidates are grouped by 32-bit word of the bitmaps (16 slots of 2
# bits); per block one 4-byte read per group ANDs away the workers whose run just ended.
# A member's mask is the low bit of its code; the word shifted right by one puts each
# code's high bit (host or disk) there too, so "held" is word | shifted and "below the pool"
# is shifted, both ANDed with the members still matching. Tiers are counted member by member
# only for a block some matching member holds below its pool, so a prompt cached in pools
# costs three bit operations more per block than a holders-only bitmap. Blocks are fetched 64
# at a time with MGET, stopping once no candidate is left.
_LONGEST_PREFIX_LUA = """
local band, bor, rshift, lshift = bit.band, bit.bor, bit.rshift, bit.lshift
local byte, sub = string.byte, string.sub
local nw = tonumber(ARGV[2])
local packed = ARGV[3 + nw]
local nb = #packed / 8
local counts, host, disk, by_word, groups = {}, {}, {}, {}, {}
for k = 1, nw do
  counts[k], host[k], disk[k] = 0, 0, 0
  local w = ARGV[2 + k]
  local reg = redis.call('HGET', WNS .. w, 'epoch')
  local st = redis.call('HMGET', SNS .. w, 'epoch', 'snap', 'slot')
  if reg and st[1] == reg and st[2] == '0' then
    local slot = tonumber(st[3])
    local wi = math.floor(slot / 16)
    local g = by_word[wi]
    if not g then
      g = {first = 4 * wi + 1, alive = 0, members = {}}
      by_word[wi] = g
      groups[#groups + 1] = g
    end
    local m = lshift(1, 30 - 2 * (slot % 16))
    g.alive = bor(g.alive, m)
    g.members[#g.members + 1] = {k, m}
  end
end
local function count_below_pool(g, below, word)
  local on_disk = band(below, word)
  for _, km in ipairs(g.members) do
    if band(below, km[2]) ~= 0 then
      if band(on_disk, km[2]) ~= 0 then
        disk[km[1]] = disk[km[1]] + 1
      else
        host[km[1]] = host[km[1]] + 1
      end
    end
  end
end
local live, done = #groups, 0
while live > 0 and done < nb do
  local stop = math.min(nb, done + 64)
  local keys = {}
  for b = done + 1, stop do keys[#keys + 1] = BITS .. sub(packed, 8 * b - 7, 8 * b) end
  local vals = redis.call('MGET', unpack(keys))
  for j = 1, #vals do
    local v = vals[j]
    for _, g in ipairs(groups) do
      local alive = g.alive
      if alive ~= 0 then
        local word = 0
        if v then
          local b1, b2, b3, b4 = byte(v, g.first, g.first + 3)
          word = (((b1 or 0) * 256 + (b2 or 0)) * 256 + (b3 or 0)) * 256 + (b4 or 0)
        end
        local shifted = rshift(word, 1)
        local now = band(alive, bor(word, shifted))
        if now ~= alive then
          for _, km in ipairs(g.members) do
            if band(alive, km[2]) ~= 0 and band(now, km[2]) == 0 then
              counts[km[1]] = done + j - 1
            end
          end
          g.alive = now
          if now == 0 then live = live - 1 end
        end
        local below = band(shifted, now)
        if below ~= 0 then count_below_pool(g, below, word) end
      end
    end
    if live == 0 then break end
  end
  done = stop
end
local out = {}
for _, g in ipairs(groups) do
  for _, km in ipairs(g.members) do
    if band(g.alive, km[2]) ~= 0 then counts[km[1]] = nb end
  end
end
for k = 1, nw do
  out[#out + 1] = counts[k]
  out[#out + 1] = host[k]
  out[#out + 1] = disk[k]
end
return out
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


APPLY_SCRIPT = _script(_APPLY_LUA)
LONGEST_PREFIX_SCRIPT = _script(_LONGEST_PREFIX_LUA)
SWEEP_SCRIPT = _script(_SWEEP_LUA)
