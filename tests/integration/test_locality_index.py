"""Locality index against a real redis-server, checked against a pure-Python model."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.cluster.kv_events import KvCleared, KvEvent, KvEventSequencer, KvSnapshot, KvStored
from pdserve.cluster.locality_index import ApplyStatus, LocalityIndex
from pdserve.cluster.redis_server import RedisServer, RedisServerConfig, connect, free_loopback_port
from pdserve.cluster.registry import HeartbeatStatus, WorkerRegistry
from pdserve.cluster.router_wiring import RedisLocality
from pdserve.engine.kv_cache.tiers import KVTier
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerLoad, WorkerRole
from pdserve.router.policies import PrefixHit
from pdserve.router.state.batched_lookups import BatchedLookups
from tests.loop_ticks import LoopTicks

WORKERS = ("w0", "w1")
UNIVERSE = range(10)
PROMPT_BLOCKS = 256


def _info(worker_id: str, epoch: int) -> WorkerInfo:
    return WorkerInfo(worker_id, WorkerRole.PREFILL, "127.0.0.1:1", "m", 64, 16, epoch)


def counts(answer: dict[str, PrefixHit]) -> dict[str, int]:
    """A lookup's answer as leading blocks per worker (tiers aside)."""
    return {w: hit.blocks for w, hit in answer.items()}


def _leading(prompt: list[int], held: set[int]) -> int:
    count = 0
    while count < len(prompt) and prompt[count] in held:
        count += 1
    return count


def _leading_hit(prompt: list[int], held: dict[int, KVTier]) -> PrefixHit:
    tiers = [held[h] for h in prompt[: _leading(prompt, set(held))]]
    return PrefixHit(len(tiers), tiers.count(KVTier.HOST), tiers.count(KVTier.DISK))


@dataclass
class _ModelState:
    epoch: int
    seq: int = 0
    awaiting: bool = False
    blocks: dict[int, KVTier] = field(default_factory=dict)


class ModelIndex:
    """The index rules of docs/redis-schema.md, written independently in plain Python."""

    def __init__(self) -> None:
        self.registered: dict[str, int] = {}
        self.state: dict[str, _ModelState] = {}

    def apply(self, ev: KvEvent) -> ApplyStatus:
        reg = self.registered.get(ev.worker_id)
        if reg is None or reg < ev.epoch:
            return ApplyStatus.NOT_REGISTERED
        st = self.state.get(ev.worker_id)
        if reg > ev.epoch or (st is not None and st.epoch > ev.epoch):
            return ApplyStatus.STALE_EPOCH
        if st is None or st.epoch != ev.epoch:
            st = self.state[ev.worker_id] = _ModelState(ev.epoch)
        if isinstance(ev, KvSnapshot):
            if ev.seq <= st.seq:
                return ApplyStatus.DUPLICATE
            tiers = ev.tiers or (KVTier.POOL,) * len(ev.block_hashes)
            st.blocks = {int(h): t for h, t in zip(ev.block_hashes, tiers, strict=True)}
            st.seq, st.awaiting = ev.seq, False
            return ApplyStatus.APPLIED
        if st.awaiting:
            return ApplyStatus.AWAITING_SNAPSHOT
        if ev.seq <= st.seq:
            return ApplyStatus.DUPLICATE
        if ev.seq > st.seq + 1:
            st.awaiting = True
            return ApplyStatus.GAP
        st.seq = ev.seq
        if isinstance(ev, KvCleared):
            st.blocks.clear()
        elif isinstance(ev, KvStored):
            st.blocks |= dict.fromkeys(map(int, ev.block_hashes), ev.tier)
        else:
            for h in ev.block_hashes:
                st.blocks.pop(int(h), None)
        return ApplyStatus.APPLIED

    def longest_prefix(self, prompt: list[int], ids: list[str]) -> dict[str, PrefixHit]:
        out = {}
        for w in ids:
            st = self.state.get(w)
            ok = st is not None and not st.awaiting and self.registered.get(w) == st.epoch
            out[w] = _leading_hit(prompt, st.blocks) if ok and st is not None else PrefixHit()
        return out


class _Worker:
    """A simulated worker: its true cache, its sequencer, and how it registers."""

    def __init__(self, worker_id: str, registry: WorkerRegistry) -> None:
        self.worker_id, self.registry = worker_id, registry
        self.held: dict[int, KVTier] = {}
        self.start()

    def start(self) -> None:
        self.held = {}
        self.seq = KvEventSequencer(self.worker_id, self.registry.allocate_epoch())
        assert self.registry.register(_info(self.worker_id, self.seq.epoch))

    def snapshot(self) -> KvSnapshot:
        hashes = sorted(self.held)
        return self.seq.snapshot(hashes, [self.held[h] for h in hashes])


# 'restart' delivers what is pending first; 'crash' restarts with events still in flight
# (they arrive after the new incarnation registered, so they are stale). 'to_host' and
# 'to_disk' store blocks below the pool (new ones, or ones that move there).
OPS = (
    "store", "store", "to_host", "to_disk", "remove", "clear", "lose", "dup", "restart",
    "crash", "snapshot", "flush",
)  # fmt: skip
_TIERS = {"store": KVTier.POOL, "lose": KVTier.POOL, "to_host": KVTier.HOST, "to_disk": KVTier.DISK}
ops = st.tuples(
    st.sampled_from(OPS), st.sampled_from(WORKERS), st.frozensets(st.sampled_from(UNIVERSE))
)


def _step(op: str, worker: _Worker, hashes: frozenset[int]) -> KvEvent | None:
    """Change the worker's true cache for ``op``; return the event it publishes, if any."""
    if op in _TIERS:
        worker.held |= dict.fromkeys(hashes, _TIERS[op])
        event: KvEvent = worker.seq.stored(sorted(hashes), _TIERS[op])
        # 'lose': numbered and applied to the cache, but the event never reaches the index.
        return event if op != "lose" else None
    if op == "remove":
        for h in hashes:
            worker.held.pop(h, None)
        return worker.seq.removed(sorted(hashes))
    if op == "clear":
        worker.held = {}
        return worker.seq.cleared()
    assert op == "snapshot", f"unexpected op {op!r}"
    return worker.snapshot()


def _check_batch(index: LocalityIndex, model: ModelIndex, batch: list[KvEvent]) -> None:
    expected = [model.apply(ev) for ev in batch]
    result = index.apply(batch)
    assert list(result.statuses) == expected
    owing = {w for w, s in model.state.items() if s.awaiting}
    gapped = {ev.worker_id for ev, s in zip(batch, expected, strict=True) if s in _OWING}
    assert result.snapshot_requests == gapped & owing


_OWING = (ApplyStatus.GAP, ApplyStatus.AWAITING_SNAPSHOT)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    script=st.lists(ops, min_size=10, max_size=50),
    prompts=st.lists(st.permutations(list(UNIVERSE)), min_size=1, max_size=3),
)
def test_matches_model_on_random_event_sequences(
    redis_client: redis.Redis,
    script: list[tuple[str, str, frozenset[int]]],
    prompts: list[list[int]],
) -> None:
    keys = RedisKeys(f"h{uuid.uuid4().hex[:12]}:")
    registry = WorkerRegistry(redis_client, keys, lease_s=60)
    index, model = LocalityIndex(redis_client, keys), ModelIndex()
    workers = {w: _Worker(w, registry) for w in WORKERS}
    model.registered = {w: x.seq.epoch for w, x in workers.items()}
    pending: list[KvEvent] = []
    last: dict[str, KvEvent] = {}
    for op, w, hashes in script:
        if op in ("flush", "restart"):
            _check_batch(index, model, pending)
            pending = []
        if op in ("flush", "restart", "crash"):
            if op != "flush":
                workers[w].start()
                model.registered[w] = workers[w].seq.epoch
        elif op == "dup":
            pending += [last[w]] if w in last else []
        elif (event := _step(op, workers[w], hashes)) is not None:
            last[w] = event
            pending.append(event)
    _check_batch(index, model, pending)

    ids = list(WORKERS)
    for prompt in prompts:
        assert index.longest_prefix(prompt, ids) == model.longest_prefix(prompt, ids)
    for w, state in model.state.items():  # reverse sets agree with the model
        assert index.blocks_of(w) == set(state.blocks)
    for h in UNIVERSE:  # forward entries (holders and their tiers) agree with the model
        expected = {w: s.blocks[h] for w, s in model.state.items() if h in s.blocks}
        assert index.holders(h) == expected

    # Once every worker has published a snapshot, the index is the truth.
    index.apply([x.snapshot() for x in workers.values()])
    for prompt in prompts:
        truth = {w: _leading_hit(prompt, x.held) for w, x in workers.items()}
        assert index.longest_prefix(prompt, ids) == truth


@pytest.fixture()
def index(redis_client: redis.Redis, keys: RedisKeys) -> LocalityIndex:
    return LocalityIndex(redis_client, keys)


@pytest.fixture()
def registry(redis_client: redis.Redis, keys: RedisKeys) -> WorkerRegistry:
    return WorkerRegistry(redis_client, keys, lease_s=30)


def test_new_epoch_drops_stale_entries(
    registry: WorkerRegistry, index: LocalityIndex, redis_client: redis.Redis, keys: RedisKeys
) -> None:
    worker = _Worker("w0", registry)
    old_seq = worker.seq
    assert index.apply([old_seq.stored([1, 2, 3])]).statuses == (ApplyStatus.APPLIED,)
    assert counts(index.longest_prefix([1, 2, 3, 4], ["w0"])) == {"w0": 3}

    worker.start()  # the process restarted: new epoch, empty cache
    # Not current any more, even before the new incarnation has published anything.
    assert counts(index.longest_prefix([1, 2, 3, 4], ["w0"])) == {"w0": 0}
    result = index.apply([worker.seq.stored([1]), old_seq.stored([2, 3])])
    assert result.statuses == (ApplyStatus.APPLIED, ApplyStatus.STALE_EPOCH)
    assert index.blocks_of("w0") == {1}
    assert not redis_client.exists(keys.block_bits(2)), "an empty bitmap is deleted"
    assert counts(index.longest_prefix([1, 2, 3, 4], ["w0"])) == {"w0": 1}


def test_unique_blocks_counts_what_only_that_worker_holds(
    registry: WorkerRegistry, index: LocalityIndex
) -> None:
    workers = {w: _Worker(w, registry) for w in ("w0", "w1", "w2")}
    index.apply([
        workers["w0"].seq.stored([1, 2, 3, 4]),
        workers["w1"].seq.stored([1, 2, 9]),
        workers["w2"].seq.stored([3]),
    ])  # fmt: skip
    assert index.unique_blocks(["w0", "w1", "w2"]) == {"w0": 1, "w1": 1, "w2": 0}
    # Among w0 and w2 only, w0 alone holds 1, 2 and 4.
    assert index.unique_blocks(["w0", "w2"]) == {"w0": 3, "w2": 0}
    assert index.unique_blocks(["w0", "nobody"]) == {"w0": 4, "nobody": 0}
    assert index.unique_blocks([]) == {}


def test_seq_gap_requests_snapshot_and_ignores_deltas(
    registry: WorkerRegistry, index: LocalityIndex
) -> None:
    worker = _Worker("w0", registry)
    seq = worker.seq
    index.apply([seq.stored([1, 2])])
    seq.stored([3])  # lost on the way
    result = index.apply([seq.stored([4]), seq.removed([1])])
    assert result.statuses == (ApplyStatus.GAP, ApplyStatus.AWAITING_SNAPSHOT)
    assert result.snapshot_requests == {"w0"}
    assert counts(index.longest_prefix([1, 2], ["w0"])) == {"w0": 0}, (
        "entries are stale until snapshot"
    )
    assert index.blocks_of("w0") == {1, 2}, "delta ignored"
    reply = registry.heartbeat("w0", seq.epoch, WorkerLoad())
    assert reply.status == HeartbeatStatus.OK and reply.snapshot_wanted

    result = index.apply([seq.snapshot([2, 3, 4]), seq.stored([5])])
    assert result.statuses == (ApplyStatus.APPLIED, ApplyStatus.APPLIED)
    assert result.snapshot_requests == frozenset()
    assert not registry.heartbeat("w0", seq.epoch, WorkerLoad()).snapshot_wanted
    assert counts(index.longest_prefix([2, 3, 4, 5, 1], ["w0"])) == {"w0": 4}


def test_lease_expiry_drops_entries(redis_client: redis.Redis, keys: RedisKeys) -> None:
    registry = WorkerRegistry(redis_client, keys, lease_s=1.0)
    index = LocalityIndex(redis_client, keys)
    dying, living = _Worker("dying", registry), _Worker("living", registry)
    index.apply([dying.seq.stored([1, 2]), living.seq.stored([1])])
    for _ in range(3):
        time.sleep(0.5)
        registry.heartbeat("living", living.seq.epoch, WorkerLoad())
    assert counts(index.longest_prefix([1, 2], ["dying", "living"])) == {"dying": 0, "living": 1}
    assert index.sweep() == ["dying"]
    assert index.blocks_of("dying") == set()
    assert index.sweep() == []
    # The worker was only paused: it learns its lease is gone, re-registers and re-publishes.
    reply = registry.heartbeat("dying", dying.seq.epoch, WorkerLoad())
    assert reply.status == HeartbeatStatus.LEASE_LOST
    assert registry.register(_info("dying", dying.seq.epoch))
    dying.held = {1: KVTier.POOL, 2: KVTier.POOL}
    assert index.apply([dying.seq.stored([3])]).statuses == (ApplyStatus.GAP,)
    assert index.apply([dying.snapshot()]).statuses == (ApplyStatus.APPLIED,)
    assert counts(index.longest_prefix([1, 2], ["dying", "living"])) == {"dying": 2, "living": 1}


@pytest.mark.parametrize("num_workers", [16, 40])  # 40: bitmap slots span two 32-bit words
def test_lookup_256_blocks_one_round_trip(
    counting_client: tuple[redis.Redis, Callable[[], int]], keys: RedisKeys, num_workers: int
) -> None:
    client, sent = counting_client
    registry = WorkerRegistry(client, keys, lease_s=30)
    index = LocalityIndex(client, keys)
    rng = random.Random(7)
    prompt = [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)]
    workers = [_Worker(f"w{i:02d}", registry) for i in range(num_workers)]
    for i, worker in enumerate(workers):  # a random prefix, plus later blocks past a hole
        n = PROMPT_BLOCKS if i == 0 else rng.randrange(0, PROMPT_BLOCKS + 1)
        held = set(prompt[:n]) | set(rng.sample(prompt, 20))
        worker.held = dict.fromkeys(held, KVTier.POOL)
        events = [worker.seq.stored(sorted(held))]
        if i % 3:  # two workers in three moved some of their blocks below the pool
            for tier in (KVTier.HOST, KVTier.DISK):
                moved = rng.sample(sorted(held), len(held) // 4)
                worker.held |= dict.fromkeys(moved, tier)
                events.append(worker.seq.stored(moved, tier))
        index.apply(events)
    ids = [w.worker_id for w in workers] + ["unknown"]
    expected = {w.worker_id: _leading_hit(prompt, w.held) for w in workers}
    expected["unknown"] = PrefixHit()
    assert len({h.blocks for h in expected.values()}) > 5, "the workload should vary"
    assert sum(h.disk_blocks > 0 for h in expected.values()) > 3, "and hold tiers"

    before_server = _evalsha_calls(client)  # INFO is a request too: read it outside the count
    before_client = sent()
    assert index.longest_prefix(prompt, ids) == expected
    assert sent() - before_client == 1, "longest_prefix must be one request"
    assert _evalsha_calls(client) - before_server == 1


def _evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_many_lookups_share_one_round_trip(
    counting_client: tuple[redis.Redis, Callable[[], int]], keys: RedisKeys
) -> None:
    client, sent = counting_client
    registry, index = WorkerRegistry(client, keys, lease_s=30), LocalityIndex(client, keys)
    for worker_id, held in (("w0", [1, 2, 3]), ("w1", [1, 9])):
        index.apply([_Worker(worker_id, registry).seq.stored(held)])
    queries = [([1, 2, 3, 4], ["w0", "w1"]), ([9], ["w1"]), ([], ["w0"]), ([1, 9], ["w1", "w0"])]
    before = sent()
    answers = [counts(a) for a in index.longest_prefix_many(queries)]
    assert sent() - before == 1, "one pipeline, one request"
    assert answers == [
        {"w0": 3, "w1": 1},
        {"w1": 1},
        {"w0": 0},
        {"w1": 2, "w0": 1},
    ]
    assert answers == [counts(index.longest_prefix(h, w)) for h, w in queries]


def test_a_hung_redis_costs_a_lookup_its_timeout_not_the_event_loop() -> None:
    """redis-server stopped (SIGSTOP), not gone: a blocking client call would hold the
    router's event loop for the whole socket timeout; the batched lookup answers empty
    within its own timeout, and the loop keeps running meanwhile."""
    server = RedisServer(RedisServerConfig(port=free_loopback_port())).start()
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=2.0)
        keys = RedisKeys("hung:")
        registry, index = WorkerRegistry(client, keys, lease_s=30), LocalityIndex(client, keys)
        index.apply([_Worker("w0", registry).seq.stored([1, 2])])
        lookups = BatchedLookups(RedisLocality(index), timeout_s=0.2)

        async def scenario() -> tuple[dict[str, PrefixHit], dict[str, PrefixHit], float, int]:
            healthy = await lookups.longest_prefix([1, 2], ["w0"])
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            async with LoopTicks(period_s=0.005) as ticks:
                start_s = time.monotonic()
                hung = await lookups.longest_prefix([1, 2], ["w0"])
                waited_s = time.monotonic() - start_s
            os.kill(server.pid, signal.SIGCONT)
            return healthy, hung, waited_s, ticks.count

        healthy, hung, waited_s, ticks = asyncio.run(scenario())
        assert counts(healthy) == {"w0": 2} and hung == {}
        assert waited_s < 1.0, f"the lookup waited {waited_s:.2f} s, past its 0.2 s timeout"
        assert ticks >= 10, "the event loop stalled while Redis hung"
        client.close()
    finally:
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


def test_bytes_hashes_and_bad_input(registry: WorkerRegistry, index: LocalityIndex) -> None:
    worker = _Worker("w0", registry)
    blocks = [bytes([i]) * 8 for i in range(4)]
    index.apply([worker.seq.stored(blocks[:3])])
    assert counts(index.longest_prefix(blocks, ["w0", "w0"])) == {"w0": 3}
    assert counts(index.longest_prefix([], ["w0"])) == {"w0": 0}
    assert counts(index.longest_prefix(blocks, [])) == {}
    for bad in (-1, 1 << 64, b"", b"1234567", "abcdefgh", 1.0):
        with pytest.raises(ValueError):
            index.longest_prefix([bad], ["w0"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        index.longest_prefix(blocks, ["no spaces allowed"])
    with pytest.raises(ValueError):
        index.apply([KvStored("w0", worker.seq.epoch, 0, (1,))])


def test_redis_restart_is_detected_and_rebuilt_from_snapshots() -> None:
    server = RedisServer(RedisServerConfig(port=free_loopback_port())).start()
    try:
        client = connect(server.url)
        keys = RedisKeys("restart:")
        registry, index = WorkerRegistry(client, keys, lease_s=30), LocalityIndex(client, keys)
        workers = [_Worker(f"w{i}", registry) for i in range(3)]
        for i, worker in enumerate(workers):
            worker.held = dict.fromkeys(range(i + 2), KVTier.POOL)
            index.apply([worker.seq.stored(sorted(worker.held))])
        prompt, ids = list(range(6)), [w.worker_id for w in workers]
        before = counts(index.longest_prefix(prompt, ids))
        assert before == {"w0": 2, "w1": 3, "w2": 4}

        server.stop()
        server.start()  # same port, empty (no persistence); the client reconnects
        assert index.check_restart()
        assert not index.check_restart(), "reported once"
        assert counts(index.longest_prefix(prompt, ids)) == dict.fromkeys(ids, 0)
        for worker in workers:  # each worker's heartbeat tells it to re-register + snapshot
            reply = registry.heartbeat(worker.worker_id, worker.seq.epoch, WorkerLoad())
            assert reply.status == HeartbeatStatus.LEASE_LOST
            assert registry.register(_info(worker.worker_id, worker.seq.epoch))
            assert index.apply([worker.snapshot()]).statuses == (ApplyStatus.APPLIED,)
        assert counts(index.longest_prefix(prompt, ids)) == before
        client.close()
    finally:
        server.stop()


def test_index_works_with_auth() -> None:
    with RedisServer(RedisServerConfig(password="pw-for-index")) as server:
        client = connect(server.url)
        keys = RedisKeys("auth:")
        worker = _Worker("w0", WorkerRegistry(client, keys))
        index = LocalityIndex(client, keys)
        index.apply([worker.seq.stored([5, 6])])
        assert counts(index.longest_prefix([5, 6, 7], ["w0"])) == {"w0": 2}
        client.close()
