"""The Redis key schema of pdserve (docs/redis-schema.md describes types, TTLs and owners).

Every key starts with one prefix so that several clusters (or tests) can share a Redis.
The Lua scripts build keys from the same namespace constants (:data:`LUA_NAMESPACES`), so the
schema lives in this file only.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

WORKER_NS = "worker:"
WORKERS_SET = "workers"
DRAINING_NS = "draining:"
EPOCH_COUNTER = "epoch_counter"
RUN_ID = "run_id"
BLOCK_BITS_NS = "idx:bits:"
WORKER_BLOCKS_NS = "idx:wblk:"
INDEX_STATE_NS = "idx:state:"
INDEX_WORKERS_SET = "idx:workers"
INDEX_SLOTS = "idx:slots"
POOL_TARGET = "pool_target"
SLO_ROUTER_NS = "slo:router:"
SLO_ROUTERS_SET = "slo:routers"
CAPACITY_PROFILE = "autoscale:profile"
WORKER_TEMPLATE = "cluster:worker_template"

# Substituted into Lua script templates ($worker_ns ...), so scripts and Python agree.
LUA_NAMESPACES: dict[str, str] = {
    "worker_ns": WORKER_NS,
    "block_bits_ns": BLOCK_BITS_NS,
    "worker_blocks_ns": WORKER_BLOCKS_NS,
    "index_state_ns": INDEX_STATE_NS,
    "index_workers_set": INDEX_WORKERS_SET,
    "index_slots": INDEX_SLOTS,
}

_WORKER_ID_RE = re.compile(r"[A-Za-z0-9._\-]{1,128}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._\-:{}]{1,64}")


def check_worker_id(worker_id: str) -> str:
    """Return ``worker_id`` if it is a valid key component, else raise ValueError."""
    if not isinstance(worker_id, str) or not _WORKER_ID_RE.fullmatch(worker_id):
        raise ValueError(f"worker_id must be 1-128 chars of [A-Za-z0-9._-], got {worker_id!r}")
    return worker_id


def block_hash_bytes(block_hash: int | bytes) -> bytes:
    """Canonical 8-byte form of a block hash: a 64-bit int big-endian, or 8 bytes as given."""
    if isinstance(block_hash, int):
        if not 0 <= block_hash < 1 << 64:
            raise ValueError(f"int block hash must be in [0, 2**64), got {block_hash}")
        return block_hash.to_bytes(8, "big")
    if isinstance(block_hash, bytes) and len(block_hash) == 8:
        return block_hash
    raise ValueError(
        f"block hash must be an int in [0, 2**64) or 8 bytes, got {type(block_hash).__name__} "
        f"{block_hash!r:.80}"
    )


def pack_block_hashes(block_hashes: Sequence[int | bytes]) -> bytes:
    """All hashes as one string of 8-byte records (what the Lua scripts take)."""
    try:  # fast path: all ints in range (about 20x faster than the loop below)
        return _packer(len(block_hashes)).pack(*block_hashes)
    except struct.error:
        return b"".join(block_hash_bytes(h) for h in block_hashes)


def unpack_block_hash(record: bytes) -> int:
    """The int form of one 8-byte record (bytes hashes come back as their int value)."""
    assert len(record) == 8, f"block hash record must be 8 bytes, got {len(record)}"
    return int.from_bytes(record, "big")


@functools.lru_cache(maxsize=64)
def _packer(count: int) -> struct.Struct:
    return struct.Struct(f">{count}Q")


@dataclass(slots=True, frozen=True)
class RedisKeys:
    """Key names under one ``prefix`` (e.g. ``"pdserve:"``; tests use a fresh one each)."""

    prefix: str = "pdserve:"

    def __post_init__(self) -> None:
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(
                f"key prefix must be 1-64 chars of [A-Za-z0-9._-:{{}}], got {self.prefix!r}"
            )

    def worker(self, worker_id: str) -> str:
        """HASH: one worker's registration and load; expires with its lease."""
        return self.prefix + WORKER_NS + worker_id

    @property
    def workers(self) -> str:
        """SET: ids that registered; members whose lease lapsed are pruned on listing."""
        return self.prefix + WORKERS_SET

    def draining(self, worker_id: str) -> str:
        """STRING: present while a worker is drained for removal (the router routes nothing
        to it); expires on its own, so a scale-in that never came gives the worker back."""
        return self.prefix + DRAINING_NS + worker_id

    @property
    def epoch_counter(self) -> str:
        """STRING: the last epoch handed out (epochs only grow, see registry.allocate_epoch)."""
        return self.prefix + EPOCH_COUNTER

    @property
    def run_id(self) -> str:
        """STRING: a random id; its disappearance means Redis restarted or was flushed."""
        return self.prefix + RUN_ID

    def block_bits(self, block_hash: int | bytes) -> bytes:
        """STRING bitmap: bit ``slot`` set <=> the worker in that slot holds this block."""
        return self.prefix.encode() + BLOCK_BITS_NS.encode() + block_hash_bytes(block_hash)

    def worker_blocks(self, worker_id: str) -> str:
        """SET: 8-byte hashes of the blocks a worker holds (reverse of :meth:`block_bits`)."""
        return self.prefix + WORKER_BLOCKS_NS + worker_id

    def index_state(self, worker_id: str) -> str:
        """HASH: epoch, last applied seq, awaiting-snapshot flag and bitmap slot of a worker."""
        return self.prefix + INDEX_STATE_NS + worker_id

    @property
    def index_slots(self) -> str:
        """HASH: bitmap slot number -> worker id (a slot is freed when its worker is swept)."""
        return self.prefix + INDEX_SLOTS

    @property
    def index_workers(self) -> str:
        """SET: ids that have entries (or state) in the locality index."""
        return self.prefix + INDEX_WORKERS_SET

    @property
    def worker_template(self) -> str:
        """STRING (JSON): how the head starts its workers (model, dtype, KV backend, server
        flags, agent settings); no TTL. Written by `pdserve up`, read by `pdserve join`,
        which starts its own workers the same way."""
        return self.prefix + WORKER_TEMPLATE

    @property
    def pool_target(self) -> str:
        """HASH: role (prefill, decode, colocated) -> target worker count; no TTL. Written by
        ``pdserve up`` at start and by ``pdserve scale`` / an autoscaler; ``up`` follows it."""
        return self.prefix + POOL_TARGET

    @property
    def capacity_profile(self) -> str:
        """STRING: JSON of the measured per-worker capacity the autoscaler sizes pools with;
        no TTL. Written by ``pdserve profile --redis-url``, read by ``pdserve planner``."""
        return self.prefix + CAPACITY_PROFILE

    def slo_router(self, router_id: str) -> str:
        """HASH: one router's latest SLO/goodput figures; expires 3 publish intervals after
        its last write (see router/observe/goodput_store.py for the fields)."""
        return self.prefix + SLO_ROUTER_NS + router_id

    @property
    def slo_routers(self) -> str:
        """SET: ids of routers that published figures; readers drop ids whose hash expired."""
        return self.prefix + SLO_ROUTERS_SET
