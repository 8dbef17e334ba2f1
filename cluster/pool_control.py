"""Target pool sizes in Redis: `pdserve up` writes them at start and follows them;
`pdserve scale` (or an autoscaler) changes them.

Key: ``RedisKeys.pool_target``, a HASH role -> worker count (no TTL).
"""

from __future__ import annotations

import logging

import redis

from pdserve.cluster.pool_manager import PoolTargets
from pdserve.proto.redis_keys import RedisKeys

log = logging.getLogger("pdserve.pool_control")

_ROLES = ("prefill", "decode", "colocated")


class PoolTargetStore:
    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self._client = client
        self._key = keys.pool_target

    def write(self, targets: PoolTargets) -> None:
        self._client.hset(self._key, mapping={role: targets.of(role) for role in _ROLES})

    def set(self, role: str, count: int, current: PoolTargets) -> PoolTargets:
        """Set one pool's target; ValueError if the result could not serve requests."""
        sizes = {r: current.of(r) for r in _ROLES}
        if role not in sizes:
            raise ValueError(f"role must be one of {list(_ROLES)}, got {role!r}")
        sizes[role] = count
        targets = PoolTargets(**sizes).check_serves()
        self.write(targets)
        return targets

    def stored(self) -> PoolTargets | None:
        """The stored targets, or None if there are none."""
        raw = self._client.hgetall(self._key)
        if not raw:
            return None
        return PoolTargets(**{_text(k): int(v) for k, v in raw.items() if _text(k) in _ROLES})

    def read(self, fallback: PoolTargets) -> PoolTargets:
        """The stored targets; ``fallback`` when Redis is down, the key is gone (Redis
        restarted: it is written back) or holds an unusable combination."""
        try:
            targets = self.stored()
            if targets is None:
                self.write(fallback)
                return fallback
            return targets
        except (redis.RedisError, OSError) as err:
            log.debug("pool targets unreadable (%r); keeping %s", err, fallback)
        except ValueError as err:
            log.warning("ignoring pool targets in Redis: %s", err)
        return fallback


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
