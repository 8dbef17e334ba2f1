"""Peer fetch rows of ``python -m pdserve.bench.kv_tiers``, on one real cluster: two prefill
workers and a decode worker (``pdserve worker`` processes, NIXL, the real model, an
embedded redis-server) and this process's router (bench/peer_cluster.py).

1. **A 4,096-token prefix fetched from a peer vs recomputed.** prefill-0 computes a prompt
   of a 4,096-token prefix (untimed), then prefill-1 serves another question on that prefix
   with ``peer_prefix`` = prefill-0 (it fetches the 256 blocks, then computes the question),
   and a question on a prefix nobody holds (it computes all of it). Time: the Prefill call to
   its first token, at the client; the fetch alone is the worker's ``phase_times.fetch_s``.
   The order alternates over the repeats, after one warm-up round; medians. prefill-0 then
   answers the fetched prompt itself: its tokens must equal prefill-1's.
2. **Shared-prefix workload over the two prefill workers**, through the router: documents
   of ``shared_prefix_tokens`` keep arriving (``groups`` of them, one every ``per_group``
   requests), and each request asks a question of ``question_tokens`` (text of
   ``bench/data``) about the new document, or else about one that came before it
   (seeded), greedy, 8 tokens each. Poisson arrivals at ``load`` requests per time to
   compute one document (row 1's compute rate), so the load is the same relative to any
   machine. The same router (joint_ttft, its cost model measured by row 1) without and with
   peer fetch, in the order without, with, with, without (so that a machine getting busier
   or quieter weighs on both alike), each run on its own documents (same lengths, same
   questions, same arrival times); the figures are over both runs of a configuration.
   Every worker runs chunked prefill steps of ``step_tokens``: a holder serves a fetch
   between two of them. Prefix hits: the prefill workers' hit tokens (fetched blocks
   included) over their prompt tokens, from GetStats before and after; TTFT at the client.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.bench.peer_cluster import PeerCluster, running_cluster, running_router
from pdserve.bench.workload import Tokenize, load_paragraphs
from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc, worker_pb2
from pdserve.router.config import RouterConfig
from pdserve.router.policies import CostModel

BLOCK_SIZE = 16
CONFIGS = {"without peer fetch": False, "with peer fetch": True}  # -> RouterConfig.peer_fetch
ABBA = ("without peer fetch", "with peer fetch", "with peer fetch", "without peer fetch")
HOLDER, FETCHER, DECODE = "prefill-0", "prefill-1", "decode-0"
MAX_TOKENS = 8


@dataclass(slots=True, frozen=True)
class FetchRow:
    config: str
    prefix_tokens: int
    repeats: int
    recompute_ttft_ms: float  # medians
    fetch_ttft_ms: float
    fetch_only_ms: float  # the worker's fetch phase
    fetched_mb: float  # per fetch
    speedup: float  # recompute TTFT / fetch TTFT
    same_tokens: float  # share of fetched prompts whose tokens equal the holder's


@dataclass(slots=True, frozen=True)
class SharedPrefixRow:
    config: str
    requests: int
    prefix_hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    p90_vs_without: float  # without peer fetch's p90 over this configuration's
    fetches: int
    fetch_fallbacks: int
    wall_s: float


@dataclass(slots=True, frozen=True)
class PeerBenchSettings:
    model: str
    dtype: str
    repeats: int = 3
    prefix_tokens: int = 4096
    groups: int = 6
    per_group: int = 4
    shared_prefix_tokens: int = 2048
    question_tokens: int = 256
    load: float = 1.0  # requests per time to compute one shared prefix
    num_blocks: int = 1024
    # Every worker's max_num_batched_tokens, and the cost model's step_tokens: a holder
    # pins the blocks of a fetch between two steps of at most this many tokens.
    step_tokens: int = 512
    rounds: int = 1  # of the ABBA order: each configuration runs the workload 2 x rounds
    seed: int = 0


class PromptTexts:
    """Distinct texts of exact token lengths: a numbered header, then the corpus from a
    moving start (the header makes every block hash distinct)."""

    def __init__(self, tokenize: Tokenize) -> None:
        self._tokenize = tokenize
        self._stream = tokenize(" ".join(load_paragraphs()))
        self._count = 0

    def take(self, num_tokens: int, kind: str = "Document") -> list[int]:
        self._count += 1
        header = self._tokenize(f"\n{kind} {self._count}:\n")
        start = (self._count * 997) % max(1, len(self._stream) - num_tokens)
        body = self._stream[start : start + num_tokens - len(header)]
        assert len(header) + len(body) == num_tokens, f"the corpus is shorter than {num_tokens}"
        return header + body

    def questions(self, count: int, num_tokens: int) -> list[list[int]]:
        return [self.take(num_tokens, "Question") for _ in range(count)]


# -- row 1: one prefix, fetched vs recomputed --------------------------------------------


def _prefill_on(
    cluster: PeerCluster,
    prefill: str,
    request_id: str,
    prompt: list[int],
    peer: worker_pb2.PeerPrefix | None = None,
) -> tuple[float, float, list[int]]:
    """ReserveKV on the decode worker, Prefill (timed to its first token), Decode; the
    seconds to the first token, the fetch phase's seconds and the tokens."""
    params = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reserve = cluster.stub(DECODE).ReserveKV(
        worker_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt), timeout=60
    )
    assert reserve.accepted, f"{DECODE} refused {request_id}"
    request = worker_pb2.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params,
        destination=reserve.destination,
        peer_prefix=peer,
    )
    sent_s = time.perf_counter()
    events = cluster.stub(prefill).Prefill(request, timeout=300)
    first = next(events).first_token
    ttft_s = time.perf_counter() - sent_s
    assert next(events).transfer.ok, f"{request_id}: the KV transfer to {DECODE} failed"
    decode = worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, params=params, first_token=first
    )
    tokens = list(first.token_ids)
    for chunk in cluster.stub(DECODE).Decode(decode, timeout=300):
        tokens += chunk.token_ids
    return ttft_s, first.phase_times.fetch_s, tokens


def fetch_vs_recompute(
    cluster: PeerCluster, texts: PromptTexts, asks: list[list[int]], s: PeerBenchSettings
) -> FetchRow:
    num_blocks = s.prefix_tokens // BLOCK_SIZE
    peer = worker_pb2.PeerPrefix(
        worker_id=HOLDER, address=cluster.workers[HOLDER].address, num_blocks=num_blocks
    )
    recompute, fetch, fetch_only, same = [], [], [], 0
    before = cluster.stats(FETCHER)
    for r in range(-1, s.repeats):  # round -1 warms both paths up (a first NIXL contact)
        held, fresh = texts.take(s.prefix_tokens), texts.take(s.prefix_tokens)
        _prefill_on(cluster, HOLDER, f"hold{r}", held + asks[0])
        runs = [("fetch", held, peer), ("recompute", fresh, None)]
        for kind, prefix, prefix_peer in runs if r % 2 == 0 else runs[::-1]:
            prompt = prefix + asks[1]
            ttft_s, fetch_s, tokens = _prefill_on(
                cluster, FETCHER, f"{kind}{r}", prompt, prefix_peer
            )
            assert fetch_s > 0 or kind == "recompute", "no fetch: the fetcher's log says why"
            if r < 0:
                continue
            if kind == "fetch":
                fetch.append(ttft_s)
                fetch_only.append(fetch_s)
                _, _, holder_tokens = _prefill_on(cluster, HOLDER, f"check{r}", prompt)
                same += holder_tokens == tokens
            else:
                recompute.append(ttft_s)
    after = cluster.stats(FETCHER)
    assert after.recompute_fallbacks == before.recompute_fallbacks, "a fetch fell back"
    fetched_bytes = (after.peer_fetched_bytes - before.peer_fetched_bytes) / (s.repeats + 1)
    return FetchRow(
        config="prefix fetched vs recomputed",
        prefix_tokens=s.prefix_tokens,
        repeats=s.repeats,
        recompute_ttft_ms=statistics.median(recompute) * 1000,
        fetch_ttft_ms=statistics.median(fetch) * 1000,
        fetch_only_ms=statistics.median(fetch_only) * 1000,
        fetched_mb=fetched_bytes / 1e6,
        speedup=statistics.median(recompute) / statistics.median(fetch),
        same_tokens=same / s.repeats,
    )


def measured_cost(
    row: FetchRow, num_tokens: int, kv_bytes_per_token: int, step_tokens: int
) -> CostModel:
    """The router's cost model from row 1: compute per prompt token, and the fetch's bytes
    per second (its fixed part included, so a little pessimistic for short prefixes)."""
    return CostModel(
        prefill_s_per_token=row.recompute_ttft_ms / 1000 / num_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        link_bytes_per_s=row.fetched_mb * 1e6 / (row.fetch_only_ms / 1000),
        step_tokens=step_tokens,
    )


# -- row 2: a shared-prefix workload through the router ---------------------------------


async def _timed_generate(
    stub: inference_pb2_grpc.InferenceStub, model: str, prompt: list[int]
) -> float:
    """Seconds from the call to the first streamed token."""
    params = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = inference_pb2.GenerateTextRequest(model=model, params=params)
    request.token_ids.ids.extend(prompt)
    sent_s = time.perf_counter()
    first_s = None
    async for response in stub.Generate(request, timeout=600):
        if first_s is None and response.chunk.token_ids:
            first_s = time.perf_counter()
    assert first_s is not None, "a request ended without a token"
    return first_s - sent_s


async def _run_workload(
    address: str, model: str, prompts: Sequence[list[int]], gaps_s: Sequence[float]
) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        tasks = []
        for prompt, gap_s in zip(prompts, gaps_s, strict=True):
            await asyncio.sleep(gap_s)
            tasks.append(asyncio.create_task(_timed_generate(stub, model, prompt)))
        return list(await asyncio.gather(*tasks))


@dataclass(slots=True)
class WorkloadTotals:
    """One configuration's runs of the shared-prefix workload, added up."""

    ttfts_s: list[float] = field(default_factory=list)
    hit_tokens: int = 0
    prompt_tokens: int = 0
    fetches: int = 0
    fallbacks: int = 0
    wall_s: float = 0.0

    def row(self, name: str, base_p90_ms: float) -> SharedPrefixRow:
        p90_ms = statistics.quantiles(self.ttfts_s, n=10)[-1] * 1000
        return SharedPrefixRow(
            config=name,
            requests=len(self.ttfts_s),
            prefix_hit_rate=self.hit_tokens / max(1, self.prompt_tokens),
            ttft_p50_ms=statistics.median(self.ttfts_s) * 1000,
            ttft_p90_ms=p90_ms,
            p90_vs_without=base_p90_ms / p90_ms,
            fetches=self.fetches,
            fetch_fallbacks=self.fallbacks,
            wall_s=self.wall_s,
        )


def run_workload(
    cluster: PeerCluster,
    config: RouterConfig,
    prompts: Sequence[list[int]],
    gaps_s: Sequence[float],
    totals: WorkloadTotals,
) -> None:
    """The workload once through a router of ``config``, added to ``totals``."""
    prefills = (HOLDER, FETCHER)
    before = {w: cluster.stats(w) for w in prefills}
    start_s = time.perf_counter()
    with running_router(cluster, config) as address:
        totals.ttfts_s += asyncio.run(_run_workload(address, cluster.model, prompts, gaps_s))
    totals.wall_s += time.perf_counter() - start_s
    after = {w: cluster.stats(w) for w in prefills}

    def delta(name: str) -> int:
        return sum(getattr(after[w], name) - getattr(before[w], name) for w in prefills)

    totals.hit_tokens += delta("prefix_hit_tokens")
    totals.prompt_tokens += delta("prompt_tokens")
    totals.fetches += delta("peer_fetches")
    totals.fallbacks += delta("recompute_fallbacks")


def document_order(s: PeerBenchSettings, rng: random.Random) -> list[int]:
    """Which document each request asks about: a new one every ``per_group`` requests,
    else one that came before the newest (while there is one)."""
    order: list[int] = []
    for i in range(s.groups * s.per_group):
        newest = i // s.per_group
        new = i % s.per_group == 0
        order.append(newest if new or newest == 0 else rng.randrange(newest))
    return order


def _shared_prompts(
    texts: PromptTexts, asks: list[list[int]], s: PeerBenchSettings, order: list[int]
) -> list[list[int]]:
    documents = [texts.take(s.shared_prefix_tokens) for _ in range(s.groups)]
    return [documents[g] + asks[i % len(asks)] for i, g in enumerate(order)]


def run_peer_bench(
    s: PeerBenchSettings, tokenize: Tokenize
) -> tuple[FetchRow, list[SharedPrefixRow]]:
    texts = PromptTexts(tokenize)
    asks = texts.questions(s.groups * s.per_group, s.question_tokens)
    # A shared, loaded machine can stall a transfer for a while: generous timeouts.
    common = ["--dtype", s.dtype, "--kv-backend", "nixl", "--torch-threads", "1"]
    common += ["--transfer-timeout-s", "120", "--reservation-timeout-s", "600"]
    common += ["--max-num-batched-tokens", str(s.step_tokens)]
    worker_args = {  # the decode worker holds every running request's KV: 4x the room
        "prefill": [*common, "--num-blocks", str(s.num_blocks)],
        "decode": [*common, "--num-blocks", str(4 * s.num_blocks)],
    }
    with (
        tempfile.TemporaryDirectory(prefix="pdserve-peer-fetch-") as tmp,
        running_cluster(Path(tmp), s.model, worker_args) as cluster,
    ):
        fetch_row = fetch_vs_recompute(cluster, texts, asks, s)
        kv_bytes = 30 * 2 * 3 * 64 * (4 if s.dtype == "float32" else 2)  # SmolLM2, per token
        cost = measured_cost(fetch_row, s.prefix_tokens + len(asks[1]), kv_bytes, s.step_tokens)
        rng = random.Random(s.seed)
        order = document_order(s, rng)
        rate = s.load / (s.shared_prefix_tokens * cost.prefill_s_per_token)
        gaps_s = [rng.expovariate(rate) for _ in order]
        totals = {name: WorkloadTotals() for name in CONFIGS}
        for name in ABBA * s.rounds:  # without, with, with, without: drift hits both alike
            config = RouterConfig(
                cost=cost,
                peer_fetch=CONFIGS[name],
                # No admission control: every request is served, however long it waits.
                adaptive_concurrency=False,
                shed_ttft_factor=0.0,
            )
            prompts = _shared_prompts(texts, asks, s, order)
            run_workload(cluster, config, prompts, gaps_s, totals[name])
    base_p90_ms = totals[ABBA[0]].row(ABBA[0], 1.0).ttft_p90_ms
    return fetch_row, [totals[name].row(name, base_p90_ms) for name in CONFIGS]


def print_tables(fetch: FetchRow, shared: Sequence[SharedPrefixRow]) -> None:
    blocks = fetch.prefix_tokens // BLOCK_SIZE
    print(
        f"\n{fetch.prefix_tokens}-token prefix, {fetch.repeats} repeats (medians): recomputed "
        f"{fetch.recompute_ttft_ms:.1f} ms, fetched {fetch.fetch_ttft_ms:.1f} ms (the fetch "
        f"itself {fetch.fetch_only_ms:.1f} ms, {fetch.fetched_mb:.1f} MB): "
        f"{fetch.speedup:.2f}x; same tokens as the holder {fetch.same_tokens:.0%}; per "
        f"block: computed {fetch.recompute_ttft_ms / blocks:.3f} ms, fetched "
        f"{fetch.fetch_only_ms / blocks:.3f} ms"
    )
    print(
        f"{'config':<20} {'requests':>8} {'prefix hits':>11} {'TTFT p50 ms':>11} "
        f"{'TTFT p90 ms':>11} {'p90 vs w/o':>10} {'fetches':>7} {'fallbacks':>9} {'wall s':>7}"
    )
    for r in shared:
        print(
            f"{r.config:<20} {r.requests:>8} {r.prefix_hit_rate:>10.1%} {r.ttft_p50_ms:>11.1f} "
            f"{r.ttft_p90_ms:>11.1f} {r.p90_vs_without:>9.2f}x {r.fetches:>7} "
            f"{r.fetch_fallbacks:>9} {r.wall_s:>7.1f}"
        )
