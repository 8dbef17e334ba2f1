"""Routing policies on crafted inputs: pure, no sockets, milliseconds."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pdserve.proto.workers import WorkerLoad, WorkerRole
from pdserve.router.policies import (
    CostModel,
    JointTtftPolicy,
    LeastLoadedPolicy,
    PeerFetch,
    PrefixAwarePolicy,
    PrefixHit,
    RoundRobinPolicy,
    RouteRequest,
    WorkerCandidate,
    make_policy,
    predict_ttft,
)

P, D, C = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.COLOCATED


def worker(worker_id: str, role: WorkerRole, **load: int) -> WorkerCandidate:
    return WorkerCandidate(worker_id, role, WorkerLoad(**load))


def cached(**blocks: int) -> dict[str, PrefixHit]:
    """Prefix hits of these many blocks, all in the workers' pools."""
    return {w: PrefixHit(n) for w, n in blocks.items()}


def pairs(decisions) -> list[tuple[str, str | None]]:
    return [(d.prefill_worker_id, d.decode_worker_id) for d in decisions]


def test_round_robin_takes_colocated_workers_in_turn() -> None:
    policy = RoundRobinPolicy()
    workers = [worker("w2", C), worker("w0", C), worker("w1", C)]
    request = RouteRequest(prompt_tokens=10)
    chosen = [policy.rank(request, workers)[0].prefill_worker_id for _ in range(4)]
    assert chosen == ["w0", "w1", "w2", "w0"]


def test_round_robin_rotates_both_pools_and_ranks_every_decode_worker() -> None:
    policy = RoundRobinPolicy()
    workers = [worker("p0", P), worker("p1", P), worker("d0", D), worker("d1", D)]
    request = RouteRequest(prompt_tokens=10)
    assert pairs(policy.rank(request, workers)) == [("p0", "d0"), ("p0", "d1")]
    assert pairs(policy.rank(request, workers)) == [("p1", "d1"), ("p1", "d0")]


def test_least_loaded_prefers_fewest_requests_then_most_free_blocks() -> None:
    workers = [
        worker("p0", P, waiting=3),
        worker("p1", P, waiting=1),
        worker("d0", D, running=2, free_blocks=100),
        worker("d1", D, running=1, free_blocks=10),
        worker("d2", D, running=1, free_blocks=50),
    ]
    ranked = LeastLoadedPolicy().rank(RouteRequest(prompt_tokens=10), workers)
    assert pairs(ranked) == [("p1", "d2"), ("p1", "d1"), ("p1", "d0")]
    assert all(d.policy == "least_loaded" for d in ranked)


def test_prefix_aware_picks_longest_cached_prefix() -> None:
    workers = [worker("w0", C, running=1), worker("w1", C, running=2), worker("w2", C)]
    request = RouteRequest(prompt_tokens=64, prefix_hits=cached(w0=1, w1=3))
    ranked = PrefixAwarePolicy(load_margin=4).rank(request, workers)
    assert [d.prefill_worker_id for d in ranked] == ["w1", "w0", "w2"]
    assert ranked[0].decode_worker_id is None


def test_prefix_aware_hot_spot_guard_skips_an_overloaded_cache_holder() -> None:
    # w1 holds the whole prefix but has 6 more requests than the idle w2 (margin 4).
    workers = [worker("w1", C, running=6), worker("w2", C), worker("w3", C, running=4)]
    request = RouteRequest(prompt_tokens=64, prefix_hits=cached(w1=4, w3=2))
    ranked = PrefixAwarePolicy(load_margin=4).rank(request, workers)
    assert [d.prefill_worker_id for d in ranked] == ["w3", "w2", "w1"]


def test_prefix_aware_sends_a_new_prefix_to_the_worker_given_the_least_new_prefix() -> None:
    workers = [worker("p0", P), worker("p1", P), worker("d0", D)]
    policy = PrefixAwarePolicy()
    fresh = RouteRequest(prompt_tokens=1088, new_blocks={"p0": 68, "p1": 0})
    assert policy.rank(fresh, workers)[0].prefill_worker_id == "p1"
    # ... but a held prefix, and then load, come before it
    held = RouteRequest(prompt_tokens=1088, prefix_hits=cached(p0=64), new_blocks={"p0": 68})
    assert policy.rank(held, workers)[0].prefill_worker_id == "p0"
    busy = [worker("p0", P), worker("p1", P, running=1), worker("d0", D)]
    assert policy.rank(fresh, busy)[0].prefill_worker_id == "p0"


def test_prefix_aware_pairs_prefix_holder_with_least_loaded_decode() -> None:
    workers = [
        worker("p0", P),
        worker("p1", P),
        worker("d0", D, running=5),
        worker("d1", D, running=1),
    ]
    request = RouteRequest(prompt_tokens=64, prefix_hits=cached(p1=2, d0=4))
    assert pairs(PrefixAwarePolicy().rank(request, workers)) == [("p1", "d1"), ("p1", "d0")]


def test_joint_trades_a_prefix_hit_against_a_loaded_worker() -> None:
    # Transfer made negligible (1 byte/token over 1 TB/s): this is about prefill vs queue.
    cost = CostModel(
        prefill_s_per_token=1e-3,
        decode_admission_s=0.0,
        kv_bytes_per_token=1,
        link_bytes_per_s=1e15,
    )
    # 512 tokens = 32 blocks; p0 holds 30 of them: 32 uncached tokens (0.032 s) vs 0.512 s.
    request = RouteRequest(prompt_tokens=512, prefix_hits=cached(p0=30))
    idle = [worker("p0", P), worker("p1", P), worker("d0", D)]
    assert JointTtftPolicy(cost).rank(request, idle)[0].prefill_worker_id == "p0"
    # With 1,000 prefill tokens queued ahead (1.0 s), the hit no longer pays.
    busy = [worker("p0", P, queued_prefill_tokens=1000), worker("p1", P), worker("d0", D)]
    best = JointTtftPolicy(cost).rank(request, busy)[0]
    assert best.prefill_worker_id == "p1"
    assert best.ttft_s == pytest.approx(0.512)
    # ... but with only 400 queued (0.4 s + 0.032 s < 0.512 s) it still does.
    some = [worker("p0", P, queued_prefill_tokens=400), worker("p1", P), worker("d0", D)]
    best = JointTtftPolicy(cost).rank(request, some)[0]
    assert best.prefill_worker_id == "p0"
    assert best.ttft_s == pytest.approx(0.432)


def test_joint_prefers_the_decode_worker_that_already_holds_the_prefix() -> None:
    # Slow link: 23,040 bytes/token over 23.04 MB/s = 1 ms per token moved.
    cost = CostModel(prefill_s_per_token=0.0, decode_admission_s=0.0, link_bytes_per_s=23.04e6)
    request = RouteRequest(prompt_tokens=160, prefix_hits=cached(d1=8))
    workers = [worker("p0", P), worker("d0", D), worker("d1", D)]
    ranked = JointTtftPolicy(cost).rank(request, workers)
    assert pairs(ranked) == [("p0", "d1"), ("p0", "d0")]
    assert ranked[0].ttft_s == pytest.approx(0.032)  # 32 tokens not yet on d1
    assert ranked[1].ttft_s == pytest.approx(0.160)


def test_joint_avoids_a_slow_measured_link_for_a_long_prompt_only() -> None:
    # d1 has 5 requests waiting (5 ms more admission), but its link from p0 measured
    # 1 GB/s against d0's 10 MB/s.
    cost = CostModel(prefill_s_per_token=1e-4, decode_admission_s=1e-3)
    links = {("p0", "d0"): 10e6, ("p0", "d1"): 1e9}
    workers = [worker("p0", P), worker("d0", D), worker("d1", D, waiting=5)]
    long = RouteRequest(prompt_tokens=2048, link_rates=links)
    ranked = JointTtftPolicy(cost).rank(long, workers)
    assert pairs(ranked) == [("p0", "d1"), ("p0", "d0")]
    # 2,048 tokens x 23,040 bytes: 4.72 s over the slow link, 0.047 s over the fast one.
    assert ranked[1].ttft_s - ranked[0].ttft_s == pytest.approx(4.67 - 0.005, abs=0.01)
    # One token moves 23 KB: 2.3 ms against 23 us, less than the queue: load decides.
    tiny = RouteRequest(prompt_tokens=1, link_rates=links)
    assert pairs(JointTtftPolicy(cost).rank(tiny, workers))[0] == ("p0", "d0")
    # Only the measured direction counts: a rate into p0 says nothing of p0 -> d0.
    reverse = RouteRequest(prompt_tokens=2048, link_rates={("d0", "p0"): 10e6})
    assert pairs(JointTtftPolicy(cost).rank(reverse, workers))[0] == ("p0", "d0")


def test_an_unmeasured_link_uses_the_cost_models_default_rate() -> None:
    cost = CostModel(prefill_s_per_token=0.0, decode_admission_s=0.0, link_bytes_per_s=23.04e6)
    workers = [worker("p0", P), worker("d0", D)]
    measured = RouteRequest(prompt_tokens=160, link_rates={("p0", "d0"): 2 * 23.04e6})
    assert predict_ttft(measured, workers[0], workers[1], cost).transfer_s == pytest.approx(0.08)
    default = RouteRequest(prompt_tokens=160, link_rates={("p1", "d0"): 1.0})
    assert predict_ttft(default, workers[0], workers[1], cost).transfer_s == pytest.approx(0.16)


def test_an_unmeasured_link_is_tried_once_another_beats_the_default() -> None:
    # p0 -> d0 (same host, say) measured at 1.5 GB/s, above the 1 GB/s default: priced at the
    # default, d1's link would never be tried and its rate never learnt.
    cost = CostModel(prefill_s_per_token=1e-4, decode_admission_s=1e-3)
    workers = [worker("p0", P), worker("d0", D), worker("d1", D)]
    request = RouteRequest(prompt_tokens=2048, link_rates={("p0", "d0"): 1.5e9})
    ranked = JointTtftPolicy(cost).rank(request, workers)
    assert pairs(ranked)[0] == ("p0", "d1")
    estimate = predict_ttft(request, workers[0], workers[2], cost)
    assert estimate.transfer_s == pytest.approx(2048 * 23_040 / 3e9)  # twice the fastest
    # Once measured slow, the fast link wins again.
    measured = RouteRequest(
        prompt_tokens=2048, link_rates={("p0", "d0"): 1.5e9, ("p0", "d1"): 12e6}
    )
    assert pairs(JointTtftPolicy(cost).rank(measured, workers))[0] == ("p0", "d0")


def test_joint_ranks_a_decode_worker_without_room_last() -> None:
    request = RouteRequest(prompt_tokens=100)  # needs 7 blocks
    workers = [
        worker("p0", P),
        worker("d0", D, free_blocks=6),
        worker("d1", D, waiting=3, free_blocks=7),
    ]
    assert pairs(JointTtftPolicy().rank(request, workers)) == [("p0", "d1"), ("p0", "d0")]


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "prefix_aware", "joint_ttft"])
def test_every_policy_falls_back_to_colocated_when_a_pool_is_empty(name: str) -> None:
    policy = make_policy(name)
    request = RouteRequest(prompt_tokens=10)
    no_decode = [worker("p0", P), worker("c0", C)]
    assert pairs(policy.rank(request, no_decode)) == [("c0", None)]
    # No colocated worker either: the remaining workers serve both phases themselves.
    only_decode = [worker("d0", D)]
    assert pairs(policy.rank(request, only_decode)) == [("d0", None)]
    assert policy.rank(request, []) == []


def test_predicted_ttft_adds_the_four_terms() -> None:
    cost = CostModel(
        prefill_s_per_token=0.01,
        decode_admission_s=0.5,
        kv_bytes_per_token=100,
        link_bytes_per_s=1000.0,
    )
    request = RouteRequest(prompt_tokens=40, block_size=16, prefix_hits=cached(p=1, d=2))
    prefill = worker("p", P, queued_prefill_tokens=10)
    decode = worker("d", D, waiting=1)
    est = predict_ttft(request, prefill, decode, cost)
    assert est.queue_s == pytest.approx(0.1)  # 10 queued tokens
    assert est.prefill_s == pytest.approx(0.24)  # 40 - 16 cached tokens
    assert est.compute_tokens == 24
    assert est.transfer_s == pytest.approx(0.8)  # (40 - 32 held) tokens x 100 B / 1000 B/s
    assert est.admission_s == pytest.approx(1.0)  # 0.5 x (1 + 1 waiting)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    cost = CostModel(prefill_s_per_token=1.0)
    request = RouteRequest(prompt_tokens=32, prefix_hits=cached(w=2))
    assert predict_ttft(request, worker("w", C), None, cost).prefill_s == pytest.approx(1.0)


def test_a_hit_costs_its_tier_loads_so_the_pool_beats_host_memory_beats_disk() -> None:
    cost = CostModel(
        prefill_s_per_token=1e-3, host_load_s_per_block=2e-3, disk_load_s_per_block=5e-3
    )
    hits = {
        "pool": PrefixHit(10),
        "host": PrefixHit(10, host_blocks=10),
        "disk": PrefixHit(10, host_blocks=2, disk_blocks=8),
    }
    request = RouteRequest(prompt_tokens=170, prefix_hits=hits)
    workers = [worker("disk", C), worker("host", C), worker("pool", C)]
    ranked = JointTtftPolicy(cost).rank(request, workers)
    assert [d.prefill_worker_id for d in ranked] == ["pool", "host", "disk"]
    est = predict_ttft(request, worker("disk", C), None, cost)
    assert est.load_s == pytest.approx(2 * 2e-3 + 8 * 5e-3)
    assert est.prefill_s == pytest.approx(0.010)  # 170 - 160 cached tokens
    assert "2 in host memory, 8 on disk" in ranked[2].reason
    # A disk hit still beats computing its 160 tokens (0.160 s) from scratch.
    assert ranked[2].ttft_s < predict_ttft(request, worker("none", C), None, cost).total_s


# Fetch figures: 1 ms per prefill token, 1 KB of KV per token over 1 MB/s (1 ms per token
# moved), no fixed setup.
FETCH_COST = CostModel(
    prefill_s_per_token=1e-3,
    decode_admission_s=0.0,
    kv_bytes_per_token=1000,
    link_bytes_per_s=1e6,
    peer_fetch_setup_s=0.0,
)


def test_an_idle_worker_fetches_the_prefix_of_a_busy_holder() -> None:
    # 0.25 ms per token moved; a worker's step is at most 256 tokens.
    cost = dataclasses.replace(FETCH_COST, link_bytes_per_s=4e6, step_tokens=256)
    # 1,024 tokens = 64 blocks; p0 holds 60 and has 1,500 tokens queued (1.5 s).
    request = RouteRequest(prompt_tokens=1024, prefix_hits=cached(p0=60))
    workers = [worker("p0", P, queued_prefill_tokens=1500), worker("p1", P), worker("d0", D)]
    best = JointTtftPolicy(cost).rank(request, workers)[0]
    assert (best.prefill_worker_id, best.fetch) == ("p1", PeerFetch("p0", 60))
    no_fetch = JointTtftPolicy(cost, peer_fetch=False).rank(request, workers)
    assert all(d.fetch is None for d in no_fetch)
    # fetch: p0's current step (0.256 s) + 960 tokens x 0.25 ms; then 64 tokens computed,
    # then 1,024 tokens' KV to d0 (0.256 s). (On p0: 1.5 + 0.064 + 0.256 s; p1 computing
    # all: 1.024 + 0.256 s.)
    assert best.ttft_s == pytest.approx(0.256 + 0.24 + 0.064 + 0.256)
    assert best.compute_tokens == 64, "the router counts only these as p1's queued work"
    assert "fetch 60 blocks from p0" in best.reason
    # Once p0's queue is short, p0 wins outright.
    workers = [worker("p0", P, queued_prefill_tokens=100), worker("p1", P), worker("d0", D)]
    best = JointTtftPolicy(cost).rank(request, workers)[0]
    assert (best.prefill_worker_id, best.fetch) == ("p0", None)


def test_a_fetch_is_chosen_only_when_moving_beats_computing() -> None:
    workers = [worker("p0", P, queued_prefill_tokens=5000), worker("p1", P), worker("d0", D)]
    request = RouteRequest(prompt_tokens=1024, prefix_hits=cached(p0=60, p1=20))
    # Moving a token (1 ms) costs as much as computing it (1 ms): no fetch, p1 computes.
    best = JointTtftPolicy(FETCH_COST).rank(request, workers)[0]
    assert (best.prefill_worker_id, best.fetch) == ("p1", None)
    # A fast link: p1 fetches only what it lacks, the 40 blocks past its own 20.
    fast = dataclasses.replace(FETCH_COST, link_bytes_per_s=1e9)
    est = predict_ttft(request, workers[1], workers[2], fast, PeerFetch("p0", 60), workers[0])
    assert est.fetch_s == pytest.approx(2.048 + 640 * 1e-6)  # p0's step + 640 tokens moved
    assert est.prefill_s == pytest.approx(0.064)


def test_a_fetch_never_asks_for_blocks_only_the_routers_placements_vouch_for() -> None:
    cost = dataclasses.replace(FETCH_COST, link_bytes_per_s=1e9, step_tokens=16)
    workers = [worker("p0", P, queued_prefill_tokens=5000), worker("p1", P), worker("d0", D)]
    # p0 was sent this prompt a moment ago; the index knows only its first 10 blocks.
    request = RouteRequest(prompt_tokens=1024, prefix_hits=cached(p0=64), pending_blocks={"p0": 54})
    best = JointTtftPolicy(cost).rank(request, workers)[0]
    assert (best.prefill_worker_id, best.fetch) == ("p1", PeerFetch("p0", 10))
    request = RouteRequest(prompt_tokens=1024, prefix_hits=cached(p0=64), pending_blocks={"p0": 64})
    assert JointTtftPolicy(cost).rank(request, workers)[0].fetch is None


def test_colocated_workers_never_fetch() -> None:
    request = RouteRequest(prompt_tokens=1024, prefix_hits=cached(c0=60))
    workers = [worker("c0", C, queued_prefill_tokens=1500), worker("c1", C)]
    fast = dataclasses.replace(FETCH_COST, link_bytes_per_s=1e12)
    assert all(d.fetch is None for d in JointTtftPolicy(fast).rank(request, workers))


def test_unknown_policy_name_is_rejected_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"routing_policy must be one of .*got 'fastest'"):
        make_policy("fastest")
    assert make_policy("Least-Loaded").name == "least_loaded"


def test_policies_import_neither_torch_nor_grpc() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['grpc'] = None\n"  # blocked: import fails
        "import pdserve.router.policies\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
