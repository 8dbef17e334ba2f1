"""The locality index's Lua scripts: every mutation and the lookup run atomically inside
Redis, one EVALSHA each (see cluster/locality_index.py for the rules they implement and
docs/redis-schema.md for the keys).

Key namespaces are substituted from ``pdserve.proto.redis_keys.LUA_NAMESPACES`` (``$worker_ns``
...), so scripts and Python build the same names; the prefix itself comes in ``ARGV[1]``.
"""

from __future__ import annotations

from string import Template

from pdserve.proto.redis_keys import LUA_NAMESPACES

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
# Returns one code per event: the values of locality_index.ApplyStatus (0 = APPLIED ...).
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


APPLY_SCRIPT = _script(_APPLY_LUA)
LONGEST_PREFIX_SCRIPT = _script(_LONGEST_PREFIX_LUA)
SWEEP_SCRIPT = _script(_SWEEP_LUA)
