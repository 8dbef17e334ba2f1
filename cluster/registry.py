"""Worker registry in Redis: registrations under a lease (key TTL) that workers renew.

A worker process allocates an epoch (its incarnation number) once at start, registers, and
then calls :meth:`WorkerRegistry.heartbeat` well inside the lease. A worker whose lease lapses
is gone: :meth:`WorkerRegistry.list_workers` no longer returns it and the locality index stops
counting its blocks. On ``LEASE_LOST`` (lease lapsed, or Redis restarted) the worker registers
again and publishes a KV snapshot; see docs/redis-schema.md. A worker about to be removed
from outside its process is drained first (:meth:`WorkerRegistry.cordon`): listings leave it
out while its heartbeats go on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum

import redis

from pdserve.proto.redis_keys import RedisKeys, check_worker_id
from pdserve.proto.workers import WorkerInfo, WorkerLoad, WorkerRole


class HeartbeatStatus(IntEnum):
    LEASE_LOST = 0  # no registration for this epoch: register again, then publish a snapshot
    OK = 1
    SUPERSEDED = 2  # a newer incarnation of this worker_id registered: this process must stop


@dataclass(slots=True, frozen=True)
class HeartbeatReply:
    status: HeartbeatStatus
    snapshot_wanted: bool  # the locality index saw a seq gap and waits for a snapshot


# KEYS: epoch counter. Max(last + 1, Redis clock in µs): unique while Redis lives, and still
# growing after a Redis restart wiped the counter (µs since 1970 < 2^53: exact in Lua doubles).
_ALLOCATE_EPOCH_LUA = """
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
local epoch = math.max(last + 1, now_us)
redis.call('SET', KEYS[1], string.format('%d', epoch))
return epoch
"""

# KEYS: worker hash, workers set. ARGV: worker_id, epoch, lease_ms, field, value, ...
_REGISTER_LUA = """
local cur = redis.call('HGET', KEYS[1], 'epoch')
if cur and tonumber(cur) > tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS: worker hash, index state hash. ARGV: epoch, lease_ms, field, value, ...
_HEARTBEAT_LUA = """
local cur = redis.call('HGET', KEYS[1], 'epoch')
if not cur then return {0, 0} end
if cur ~= ARGV[1] then
  if tonumber(cur) > tonumber(ARGV[1]) then return {2, 0} end
  return {0, 0}
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local snap = redis.call('HGET', KEYS[2], 'snap')
if snap == '1' then return {1, 1} end
return {1, 0}
"""

# KEYS: worker hash, workers set. ARGV: worker_id, epoch.
_DEREGISTER_LUA = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: workers set. ARGV: worker key prefix, draining key prefix. Returns
# {id, {field, value, ...}} for live ones not being drained, and prunes ids whose lease lapsed.
_LIST_LUA = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local fields = redis.call('HGETALL', ARGV[1] .. id)
  if #fields == 0 then
    redis.call('SREM', KEYS[1], id)
  elseif redis.call('EXISTS', ARGV[2] .. id) == 0 then
    out[#out + 1] = fields
  end
end
return out
"""

# KEYS: worker hash, draining key. ARGV: ttl_ms. Marks a registered worker as draining.
_CORDON_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
return 1
"""


def check_registration(info: WorkerInfo) -> None:
    """ValueError unless ``info`` can be registered: a Redis-safe id, a model, a known KV
    capacity and an epoch from :meth:`WorkerRegistry.allocate_epoch`."""
    check_worker_id(info.worker_id)
    if not info.model or info.kv_capacity_blocks <= 0 or info.epoch <= 0:
        raise ValueError(
            "a registration needs a model, kv_capacity_blocks > 0 and epoch > 0, got "
            f"{info.model!r}, {info.kv_capacity_blocks}, {info.epoch}"
        )


def _load_fields(load: WorkerLoad) -> list[str | int]:
    return [
        "waiting", load.waiting,
        "running", load.running,
        "free_blocks", "" if load.free_blocks is None else load.free_blocks,
        "extra", json.dumps(dict(load.extra)),
    ]  # fmt: skip


def _info_fields(info: WorkerInfo) -> list[str | int]:
    return [
        "worker_id", info.worker_id,
        "role", info.role.value,
        "address", info.address,
        "model", info.model,
        "kv_capacity_blocks", info.kv_capacity_blocks,
        "block_size", info.block_size,
        "epoch", info.epoch,
        *_load_fields(info.load),
    ]  # fmt: skip


def _text(value: bytes | str) -> str:
    # Works whether or not the client was made with decode_responses=True.
    return value.decode() if isinstance(value, bytes) else value


def _parse_info(flat: list[bytes | str]) -> WorkerInfo:
    f = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}
    extra = json.loads(f["extra"])
    load = WorkerLoad(
        waiting=int(f["waiting"]),
        running=int(f["running"]),
        free_blocks=int(f["free_blocks"]) if f["free_blocks"] else None,
        extra=tuple(sorted((str(k), float(v)) for k, v in extra.items())),
    )
    return WorkerInfo(
        worker_id=f["worker_id"],
        role=WorkerRole(f["role"]),
        address=f["address"],
        model=f["model"],
        kv_capacity_blocks=int(f["kv_capacity_blocks"]),
        block_size=int(f["block_size"]),
        epoch=int(f["epoch"]),
        load=load,
    )


class WorkerRegistry:
    """Registrations of workers under leases of ``lease_s`` seconds, in one Redis."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, lease_s: float = 10.0) -> None:
        if lease_s < 0.01:
            raise ValueError(f"lease_s must be >= 0.01 (Redis TTLs are in ms), got {lease_s}")
        self._client = client
        self._keys = keys
        self.lease_ms = round(lease_s * 1000)
        self._allocate = client.register_script(_ALLOCATE_EPOCH_LUA)
        self._register = client.register_script(_REGISTER_LUA)
        self._heartbeat = client.register_script(_HEARTBEAT_LUA)
        self._deregister = client.register_script(_DEREGISTER_LUA)
        self._list = client.register_script(_LIST_LUA)
        self._cordon = client.register_script(_CORDON_LUA)

    def allocate_epoch(self) -> int:
        """A new incarnation number, larger than any handed out before by this Redis."""
        return int(self._allocate(keys=[self._keys.epoch_counter]))

    def register(self, info: WorkerInfo) -> bool:
        """Register (or re-register) ``info`` under a fresh lease.

        Returns False, changing nothing, when a newer epoch of the same worker_id is registered
        (this process is a stale incarnation).
        """
        check_registration(info)
        keys = [self._keys.worker(info.worker_id), self._keys.workers]
        args = [info.worker_id, info.epoch, self.lease_ms, *_info_fields(info)]
        return bool(self._register(keys=keys, args=args))

    def heartbeat(self, worker_id: str, epoch: int, load: WorkerLoad) -> HeartbeatReply:
        """Renew the lease and publish ``load``; the reply says whether to re-register."""
        keys = [self._keys.worker(check_worker_id(worker_id)), self._keys.index_state(worker_id)]
        status, snap = self._heartbeat(keys=keys, args=[epoch, self.lease_ms, *_load_fields(load)])
        return HeartbeatReply(HeartbeatStatus(int(status)), bool(snap))

    def deregister(self, worker_id: str, epoch: int) -> bool:
        """Remove the registration if it is still this epoch's; True if one was removed."""
        keys = [self._keys.worker(check_worker_id(worker_id)), self._keys.workers]
        return bool(self._deregister(keys=keys, args=[worker_id, epoch]))

    def cordon(self, worker_id: str, ttl_s: float) -> bool:
        """Drain ``worker_id`` for removal: :meth:`list_workers` (what the routers route to)
        leaves it out for ``ttl_s`` seconds, while its heartbeats keep its registration and
        load current (:meth:`get`). False, changing nothing, if it is not registered."""
        if ttl_s < 0.01:
            raise ValueError(f"ttl_s must be >= 0.01 (Redis TTLs are in ms), got {ttl_s}")
        keys = [self._keys.worker(check_worker_id(worker_id)), self._keys.draining(worker_id)]
        return bool(self._cordon(keys=keys, args=[round(ttl_s * 1000)]))

    def uncordon(self, worker_id: str) -> None:
        """Route to ``worker_id`` again (a drain whose removal did not happen)."""
        self._client.delete(self._keys.draining(check_worker_id(worker_id)))

    def get(self, worker_id: str) -> WorkerInfo | None:
        """The live registration of ``worker_id`` (drained or not), or None."""
        flat = self._client.hgetall(self._keys.worker(check_worker_id(worker_id)))
        if not flat:
            return None
        return _parse_info([x for kv in flat.items() for x in kv])

    def list_workers(self, role: WorkerRole | None = None) -> list[WorkerInfo]:
        """Live workers (lease not lapsed, not drained for removal), optionally of one role,
        sorted by worker_id."""
        prefixes = [self._keys.worker(""), self._keys.draining("")]
        rows = self._list(keys=[self._keys.workers], args=prefixes)
        infos = [_parse_info(row) for row in rows]
        if role is not None:
            infos = [i for i in infos if i.role == role]
        return sorted(infos, key=lambda i: i.worker_id)
