"""Latency of the locality index's prefix lookup: 256-block prompt x 16 workers.

Method: a real redis-server (embedded, or ``--redis-url``) on loopback; 16 registered prefill
workers, each caching ``--blocks-per-worker`` blocks. The cached content follows a chat-like
workload: ``--groups`` shared system prompts of 32 blocks (each worker holds a few groups),
and multi-turn conversations of 256 blocks, each cached by 1-3 workers up to a random depth;
the rest of every cache is unrelated blocks. "chat, tiers" is the same caches with each block
in the pool, host memory or on disk at random, so the lookup also counts tiers. Each lookup
draws a conversation and asks all 16
workers at once. Latency is wall time of ``LocalityIndex.longest_prefix`` (client hashing to
hex, one EVALSHA, parsing); round trips are requests written to the socket, counted by a
connection subclass.

    .venv/bin/python -m pdserve.bench.index_lookup [--lookups 2000] [--redis-url redis://...]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import redis

from pdserve.cluster.kv_events import KvEventSequencer
from pdserve.cluster.locality_index import LocalityIndex
from pdserve.cluster.redis_server import embedded_or_external
from pdserve.cluster.registry import WorkerRegistry
from pdserve.engine.kv_cache.tiers import KVTier
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerRole

PROMPT_BLOCKS = 256
SYSTEM_BLOCKS = 32


class _CountingConnection(redis.Connection):
    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sent += 1
        super().send_packed_command(command, check_health)


@dataclass(slots=True, frozen=True)
class LookupStats:
    p50_us: float
    p90_us: float
    p99_us: float
    mean_us: float
    round_trips_per_lookup: float
    server_us_per_lookup: float  # Redis's own time in the script (INFO commandstats)
    mean_prefix_blocks: float  # over all (lookup, worker) pairs


def _conversations(rng: random.Random, groups: int, count: int) -> list[list[int]]:
    systems = [[rng.getrandbits(64) for _ in range(SYSTEM_BLOCKS)] for _ in range(groups)]
    tail = PROMPT_BLOCKS - SYSTEM_BLOCKS
    return [
        systems[rng.randrange(groups)] + [rng.getrandbits(64) for _ in range(tail)]
        for _ in range(count)
    ]


def _worker_caches(
    rng: random.Random, convs: list[list[int]], workers: int, blocks_per_worker: int
) -> list[set[int]]:
    caches: list[set[int]] = [set() for _ in range(workers)]
    for conv in convs:  # each conversation cached by 1-3 workers, to a random depth
        depth = rng.randrange(SYSTEM_BLOCKS, PROMPT_BLOCKS + 1)
        for w in rng.sample(range(workers), rng.randint(1, 3)):
            caches[w].update(conv[:depth])
    for cache in caches:  # unrelated traffic fills the rest of each cache
        while len(cache) < blocks_per_worker:
            cache.add(rng.getrandbits(64))
    return caches


def _populate(
    client: redis.Redis, keys: RedisKeys, caches: list[set[int]], rng: random.Random | None = None
) -> list[str]:
    """Register one worker per cache and index it; with ``rng``, each block lives in the
    pool, host memory or on disk at random (a third each)."""
    registry, index = WorkerRegistry(client, keys, lease_s=600), LocalityIndex(client, keys)
    ids = []
    for i, cache in enumerate(caches):
        info = WorkerInfo(f"prefill-{i:02d}", WorkerRole.PREFILL, f"127.0.0.1:{7000 + i}",
                          "SmolLM2-135M-Instruct", 8192, 16, registry.allocate_epoch())  # fmt: skip
        registry.register(info)
        hashes = sorted(cache)
        tiers = [rng.choice(list(KVTier)) for _ in hashes] if rng is not None else []
        index.apply([KvEventSequencer(info.worker_id, info.epoch).snapshot(hashes, tiers)])
        ids.append(info.worker_id)
    return ids


def _evalsha_usec_calls(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("usec", 0)), int(stats.get("calls", 0))


def measure(
    client: redis.Redis, index: LocalityIndex, prompts: list[list[int]], ids: list[str]
) -> LookupStats:
    """Time one ``longest_prefix`` per prompt (after a short warm-up)."""
    for prompt in prompts[:50]:
        index.longest_prefix(prompt, ids)
    latencies_us: list[float] = []
    found: list[int] = []
    usec_before, calls_before = _evalsha_usec_calls(client)
    sent_before = _CountingConnection.sent
    for prompt in prompts:
        start = time.perf_counter_ns()
        result = index.longest_prefix(prompt, ids)
        latencies_us.append((time.perf_counter_ns() - start) / 1000)
        found.extend(hit.blocks for hit in result.values())
    trips = (_CountingConnection.sent - sent_before) / len(prompts)
    usec_after, calls_after = _evalsha_usec_calls(client)
    server_us = (usec_after - usec_before) / max(1, calls_after - calls_before)
    q = statistics.quantiles(latencies_us, n=100)
    return LookupStats(q[49], q[89], q[98], statistics.fmean(latencies_us), trips, server_us,
                       statistics.fmean(found))  # fmt: skip


def run(url: str, lookups: int, groups: int, blocks_per_worker: int, seed: int) -> None:
    rng = random.Random(seed)
    pool = redis.ConnectionPool.from_url(url, connection_class=_CountingConnection)
    client = redis.Redis(connection_pool=pool)
    keys = RedisKeys(f"bench{rng.getrandbits(32):08x}:")
    convs = _conversations(rng, groups, 400)
    caches = _worker_caches(rng, convs, 16, blocks_per_worker)
    ids = _populate(client, keys, caches)
    tier_keys = RedisKeys(keys.prefix.rstrip(":") + "t:")
    tier_ids = _populate(client, tier_keys, caches, rng)
    index, tier_index = LocalityIndex(client, keys), LocalityIndex(client, tier_keys)
    chat = [rng.choice(convs) for _ in range(lookups)]
    cases = {
        "chat overlap": (index, chat, ids),
        "chat, tiers": (tier_index, chat, tier_ids),
        "cold (no hit)": (
            index,
            [[rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)]] * lookups,
            ids,
        ),
        "all hold all": (index, _all_hold_all(client, keys, rng, lookups), _ALL_IDS),
    }
    print(f"{'case':<14} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} {'mean us':>8} "
          f"{'trips':>6} {'server us':>9} {'avg hit blk':>11}")  # fmt: skip
    for name, (case_index, prompts, case_ids) in cases.items():
        s = measure(client, case_index, prompts, case_ids)
        print(f"{name:<14} {s.p50_us:8.0f} {s.p90_us:8.0f} {s.p99_us:8.0f} {s.mean_us:8.0f} "
              f"{s.round_trips_per_lookup:6.2f} {s.server_us_per_lookup:9.0f} "
              f"{s.mean_prefix_blocks:11.1f}")  # fmt: skip
    for prefix in (keys.prefix, tier_keys.prefix):
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)
    client.close()


_ALL_IDS = [f"full-{i:02d}" for i in range(16)]


def _all_hold_all(
    client: redis.Redis, keys: RedisKeys, rng: random.Random, lookups: int
) -> list[list[int]]:
    # Worst case for the script: every worker holds every block, so nobody drops out early.
    prompt = [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)]
    registry, index = WorkerRegistry(client, keys, lease_s=600), LocalityIndex(client, keys)
    for worker_id in _ALL_IDS:
        epoch = registry.allocate_epoch()
        registry.register(WorkerInfo(worker_id, WorkerRole.PREFILL, "x:1", "m", 512, 16, epoch))
        index.apply([KvEventSequencer(worker_id, epoch).snapshot(prompt)])
    return [prompt] * lookups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--redis-url", default=None, help="use this Redis; default: embedded")
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--groups", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--blocks-per-worker", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with embedded_or_external(args.redis_url) as url:
        run(url, args.lookups, args.groups, args.blocks_per_worker, args.seed)


if __name__ == "__main__":
    main()
