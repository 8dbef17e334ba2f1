"""`pdserve up --prefill 2 --decode 2` under faults, each with the outcome a client sees.

One cluster for the module (real Ray, redis-server, four worker actors with the real model):

- 2 x 2 answers equal the offline engine; both workers of each pool serve;
- a prefill worker SIGKILLed: the request the router sends it is retried on the other one
  (before the first token) and the answer is unchanged; Ray restarts the worker, whose new
  incarnation has a new epoch, and the index has dropped the old incarnation's blocks;
- redis-server SIGKILLed: requests keep being answered (routing on load alone, last known
  workers); `pdserve up` restarts Redis, workers re-register and re-publish their caches,
  and prefix-aware routing is back;
- scale-down drains: the removed decode worker leaves the registry at once but finishes the
  request it runs; scale-up brings a worker that registers only once warm.

Without Ray or Redis (worker processes and an in-process router, so it starts in seconds):

- a decode worker frozen (SIGSTOP) mid-stream for 5 s: the stream completes with the
  offline engine's tokens, the worker serves again after SIGCONT;
- a decode worker SIGKILLed mid-stream: the router replays prompt + the tokens sent so far
  on the other decode worker, and the client's greedy stream equals the offline engine's,
  with no token lost or repeated; the next request is served. The surviving worker's own
  Prometheus endpoint answers.
- a worker that vanishes without a word: the router's directory thread sweeps its index
  entries once its lease lapses, with no lookup needed to notice.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import openai
import pytest
import redis

from pdserve.cluster.kv_events import KvEventSequencer
from pdserve.cluster.locality_index import LocalityIndex
from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.router_wiring import RedisWorkerDirectory
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerRole
from pdserve.router.edge.tokenizer import load_router_tokenizer
from pdserve.router.state.locality import engine_prompt_hasher
from tests.integration.cluster_proc import (
    UpProcess,
    alive,
    descendants,
    grpc_generate,
    redis_client,
    start_up,
    wait_until,
)
from tests.integration.stub_worker import StubCluster, start_router_for
from tests.integration.worker_procs import WorkerProc, launch_worker, offline_llm, running

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 12
RESTART_TIMEOUT_S = 300.0
PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village by the sea, there lived",
)
# Several full blocks (16 tokens each), so that the index holds it and routing follows it.
LONG_PROMPT = (
    "The lighthouse keeper wrote in the log every evening: the direction of the wind, the "
    "height of the waves, the ships that passed and the colour of the sky at dusk. On the "
    "last page of the old log he wrote"
)
OTHER_PROMPT = (
    "A recipe for bread needs flour, water, salt and yeast. Mix them, knead the dough for "
    "ten minutes, let it rise for an hour, shape it and bake it until"
)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    proc = start_up(tmp_path_factory.mktemp("cluster_faults"), "--prefill", "2", "--decode", "2")
    try:
        offline_llm()
        proc.wait_serving()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reference() -> Any:
    return offline_llm()


def expected_ids(
    llm: Any, prompt_ids: list[int], max_tokens: int = MAX_TOKENS, ignore_eos: bool = False
) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return list(llm.generate([prompt_ids], params)[0].token_ids)


class Redis:
    """Registry and index of the cluster under test."""

    def __init__(self, up: UpProcess) -> None:
        self.client = redis_client(up)
        keys = RedisKeys(up.state["key_prefix"])
        self.registry = WorkerRegistry(self.client, keys)
        self.keys = keys

    def index(self) -> LocalityIndex:  # built per use: Redis may have restarted meanwhile
        return LocalityIndex(self.client, self.keys)

    def epochs(self) -> dict[str, int]:
        return {w.worker_id: w.epoch for w in self.registry.list_workers()}

    def pid(self, worker_id: str) -> int:
        info = self.registry.get(worker_id)
        assert info is not None, f"{worker_id} is not registered"
        return int(dict(info.load.extra)["pid"])

    def holds(self, worker_id: str, hashes: list[int]) -> bool:
        return self.index().longest_prefix(hashes, [worker_id])[worker_id].blocks == len(hashes)


@pytest.fixture(scope="module")
def rds(up: UpProcess) -> Iterator[Redis]:
    r = Redis(up)
    yield r
    r.client.close()


def test_two_by_two_answers_equal_the_offline_engine(up: UpProcess, reference: Any) -> None:
    tok = reference.tokenizer
    used: set[tuple[str, str]] = set()
    for prompt in PROMPTS:  # round robin: consecutive requests take the other workers
        ids = tok.encode(prompt)
        got = grpc_generate(up.grpc_address, ids, MAX_TOKENS, policy="round_robin")
        assert got.token_ids == expected_ids(reference, ids), prompt
        used.add((got.prefill_worker, got.decode_worker))
    assert {p for p, _ in used} == {"prefill-0", "prefill-1"}
    assert {d for _, d in used} == {"decode-0", "decode-1"}
    client = openai.OpenAI(base_url=up.http_url + "/v1", api_key="unused", max_retries=0)

    def complete(prompt: str) -> str:
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return r.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: joint routing spreads them
        texts = list(pool.map(complete, PROMPTS))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    assert texts == [out.text for out in reference.generate(list(PROMPTS), params)]


def test_killed_prefill_worker_is_retried_and_replaced_with_a_new_epoch(
    up: UpProcess, reference: Any, rds: Redis
) -> None:
    ids = reference.tokenizer.encode(LONG_PROMPT)
    hashes = list(engine_prompt_hasher(MODEL)(ids))
    expected = expected_ids(reference, ids)
    first = grpc_generate(up.grpc_address, ids, MAX_TOKENS)
    assert first.token_ids == expected
    victim = first.prefill_worker
    survivor = ({"prefill-0", "prefill-1"} - {victim}).pop()
    wait_until(lambda: rds.holds(victim, hashes), 10, f"{victim}'s blocks in the index")
    old_epoch, old_pid = rds.epochs()[victim], rds.pid(victim)

    os.kill(old_pid, signal.SIGKILL)
    # Its lease is still live and it holds the prompt: the router picks it, fails before the
    # first token, and retries on the survivor. The client sees only the right answer.
    retried = grpc_generate(up.grpc_address, ids, MAX_TOKENS)
    assert retried.token_ids == expected
    assert retried.prefill_worker == survivor

    # Ray restarts the actor; the new incarnation registers with a newer epoch and its
    # snapshot replaced the dead one's entries: the old blocks are gone from the index.
    wait_until(
        lambda: rds.epochs().get(victim, old_epoch) > old_epoch,
        RESTART_TIMEOUT_S,
        f"{victim} to come back",
    )
    assert rds.pid(victim) != old_pid and not alive(old_pid)
    assert rds.index().longest_prefix(hashes, [victim])[victim].blocks == 0
    assert not set(hashes) & rds.index().blocks_of(victim)
    rows = {w["worker_id"]: w for w in up.status()["workers"]}
    assert rows[victim]["epoch"] == rds.epochs()[victim]
    again = grpc_generate(up.grpc_address, ids, MAX_TOKENS)  # all four serve again
    assert again.token_ids == expected


def test_redis_killed_then_restarted_degrades_to_load_routing_and_recovers(
    up: UpProcess, reference: Any, rds: Redis
) -> None:
    ids = reference.tokenizer.encode(OTHER_PROMPT)
    hashes = list(engine_prompt_hasher(MODEL)(ids))
    expected = expected_ids(reference, ids)
    holder = grpc_generate(up.grpc_address, ids, MAX_TOKENS).prefill_worker
    wait_until(lambda: rds.holds(holder, hashes), 10, f"{holder}'s blocks in the index")
    (redis_pid,) = [p for p, cmd in descendants(up.process.pid).items() if "redis-server" in cmd]

    os.kill(redis_pid, signal.SIGKILL)
    during = grpc_generate(up.grpc_address, ids, MAX_TOKENS)  # no index, no registry
    assert during.token_ids == expected

    # `pdserve up` restarts Redis (empty); heartbeats get LEASE_LOST, the workers register
    # again and publish snapshots, so the index knows the holder's blocks again.
    wait_until(lambda: len(rds.epochs()) == 4, 180, "all four workers to re-register")
    wait_until(lambda: rds.holds(holder, hashes), 180, "the index to be rebuilt")
    after = grpc_generate(up.grpc_address, ids, MAX_TOKENS)
    assert after.token_ids == expected
    assert after.prefill_worker == holder  # prefix-aware (joint) routing is back
    assert up.status()["live"] == {"prefill": 2, "decode": 2, "colocated": 0}


def test_scale_down_drains_a_busy_decode_worker_and_scale_up_adds_one(
    up: UpProcess, reference: Any, rds: Redis
) -> None:
    # Long enough that both requests are seen running at once in the workers' published
    # loads (one heartbeat a second). Without ignore_eos the first prompt ends after 30
    # tokens, a window a heartbeat can miss: CI once timed out waiting for it.
    long_tokens = 192
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
    with ThreadPoolExecutor(2) as pool:
        # Two long requests at once, on different decode workers (consecutive round-robin
        # turns), so whichever worker is drained has a request running.
        futures = [
            pool.submit(
                grpc_generate, up.grpc_address, ids, long_tokens, "round_robin", ignore_eos=True
            )
            for ids in prompts
        ]
        wait_until(
            lambda: sum(w.load.running for w in rds.registry.list_workers()) >= 2,
            30,
            "both requests to run",
        )
        out = up.cli("scale", "decode", "1")
        assert out.returncode == 0, out.stderr
        wait_until(lambda: len([w for w in rds.epochs() if w.startswith("decode")]) == 1, 30,
                   "a decode worker to deregister")  # fmt: skip
        results = [f.result(timeout=300) for f in futures]
    for ids, got in zip(prompts, results, strict=True):
        assert got.token_ids == expected_ids(reference, ids, long_tokens, ignore_eos=True)
    assert {got.decode_worker for got in results} == {"decode-0", "decode-1"}
    status = up.status()
    assert status["targets"]["decode"] == 1 and status["live"]["decode"] == 1

    out = up.cli("scale", "decode", "2")
    assert out.returncode == 0, out.stderr
    assert up.status()["live"]["decode"] == 1  # the new one is loading, not yet listed
    wait_until(lambda: up.status()["live"]["decode"] == 2, RESTART_TIMEOUT_S, "scale-up")
    ids = reference.tokenizer.encode(PROMPTS[3])
    assert grpc_generate(up.grpc_address, ids, MAX_TOKENS).token_ids == expected_ids(reference, ids)
    bad = up.cli("scale", "prefill", "0")  # decode without prefill cannot serve
    assert bad.returncode == 2 and "no worker can run a prompt" in bad.stderr


# -- a decode worker killed mid-stream (worker processes, in-process router) ---------------

FAILOVER_TOKENS = 40
FREEZE_S = 5.0


@pytest.fixture(scope="module")
def one_by_two(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, WorkerProc], StubCluster]]:
    """1 prefill + 2 decode worker processes and a router in front of them. The tests that
    use it run in file order: the freeze leaves both decode workers serving, the kill last."""
    tmp_path = tmp_path_factory.mktemp("one_by_two")
    common = ("--num-blocks", "64", "--kv-backend", "nixl")
    launched = [launch_worker("prefill-0", "prefill", tmp_path, *common)]
    launched += [launch_worker(f"decode-{i}", "decode", tmp_path, *common) for i in range(2)]
    try:  # these two load while the workers load
        tokenizer = load_router_tokenizer(MODEL)
        offline_llm()
    except BaseException:
        for worker in launched:
            worker.stop()
        raise
    with running(launched) as workers:
        infos = [WorkerInfo(w.name, WorkerRole(w.role), w.address) for w in workers]
        router = start_router_for(infos, tokenizer)
        try:
            yield {w.name: w for w in workers}, router
        finally:
            router.stop()


def serving_decode_worker(workers: dict[str, WorkerProc]) -> WorkerProc:
    (serving,) = [w for w in workers.values() if w.role == "decode" and w.stats().running]
    return serving


def failover_greedy(reference: Any, prompt: str) -> tuple[list[int], Any]:
    """``prompt``'s ids and the offline engine's greedy output of ``FAILOVER_TOKENS``."""
    ids = reference.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=FAILOVER_TOKENS, temperature=0.0, ignore_eos=True)
    (expected,) = reference.generate([ids], params)
    return ids, expected


def stream_striking_mid_way(
    router: StubCluster,
    ids: list[int],
    strike: Callable[[WorkerProc], None],
    workers: dict[str, WorkerProc],
) -> tuple[list[inference_pb2.GenerateTextResponse], WorkerProc]:
    """A greedy stream of ``FAILOVER_TOKENS``; after its 4th token ``strike`` hits the decode
    worker serving it. The responses, and the worker struck."""
    request = inference_pb2.GenerateTextRequest(
        token_ids=inference_pb2.TokenIds(ids=ids),
        params=common_pb2.SamplingParams(
            max_tokens=FAILOVER_TOKENS, temperature=0.0, ignore_eos=True
        ),
    )
    responses: list[inference_pb2.GenerateTextResponse] = []
    struck: WorkerProc | None = None
    with grpc.insecure_channel(router.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for response in stub.Generate(request, timeout=120):
            responses.append(response)
            if struck is None and sum(len(r.chunk.token_ids) for r in responses) >= 4:
                struck = serving_decode_worker(workers)
                strike(struck)
    assert struck is not None
    return responses, struck


def test_decode_worker_frozen_mid_stream_the_stream_completes_unchanged(
    one_by_two: tuple[dict[str, WorkerProc], StubCluster], reference: Any
) -> None:
    # SIGSTOP for longer than the router's keepalive allows (3 s): whether the stream waits
    # for the worker or is replayed on the other one, its tokens are the offline engine's.
    workers, router = one_by_two
    ids, expected = failover_greedy(reference, OTHER_PROMPT)
    resumes: list[threading.Timer] = []

    def freeze(worker: WorkerProc) -> None:
        os.kill(worker.process.pid, signal.SIGSTOP)
        resumes.append(threading.Timer(FREEZE_S, os.kill, (worker.process.pid, signal.SIGCONT)))
        resumes[-1].start()

    try:
        responses, frozen = stream_striking_mid_way(router, ids, freeze, workers)
    finally:
        for timer in resumes:
            timer.join()
    assert [t for r in responses for t in r.chunk.token_ids] == expected.token_ids
    assert responses[-1].chunk.finish_reason == "length"
    assert frozen.stats().free_blocks > 0  # resumed, it answers
    again = grpc_generate(router.grpc_address, ids, MAX_TOKENS)  # the cluster keeps serving
    assert again.token_ids == expected_ids(reference, ids)


def test_decode_worker_killed_mid_stream_the_stream_goes_on_unchanged(
    one_by_two: tuple[dict[str, WorkerProc], StubCluster], reference: Any
) -> None:
    workers, router = one_by_two
    ids, expected = failover_greedy(reference, LONG_PROMPT)
    responses, victim = stream_striking_mid_way(router, ids, WorkerProc.kill, workers)
    got_ids = [t for r in responses for t in r.chunk.token_ids]
    assert got_ids == expected.token_ids  # none lost, none repeated, the same greedy tokens
    assert "".join(r.chunk.text for r in responses) == expected.text
    (survivor,) = [w for w in workers.values() if w.role == "decode" and w is not victim]
    assert responses[-1].decode_worker == survivor.name
    assert responses[-1].chunk.finish_reason == "length"

    again = grpc_generate(router.grpc_address, ids, MAX_TOKENS)  # the cluster keeps serving
    assert again.token_ids == expected_ids(reference, ids)
    assert again.decode_worker == survivor.name
    metrics = httpx.get(f"http://127.0.0.1:{survivor.info['metrics_port']}/metrics", timeout=10)
    assert "pdserve_worker_up 1.0" in metrics.text
    assert f'pdserve_worker_running{{role="decode",worker="{survivor.name}"}}' in metrics.text


def test_the_router_sweeps_the_entries_of_a_worker_whose_lease_lapsed(
    redis_client: redis.Redis, keys: RedisKeys
) -> None:
    registry = WorkerRegistry(redis_client, keys, lease_s=0.5)
    index = LocalityIndex(redis_client, keys)
    seq = KvEventSequencer("gone", registry.allocate_epoch())
    info = WorkerInfo("gone", WorkerRole.PREFILL, "127.0.0.1:1", "m", 64, 16, seq.epoch)
    assert registry.register(info)
    index.apply([seq.stored([11, 12, 13])])
    directory = RedisWorkerDirectory(registry, index, refresh_s=0.05, sweep_s=0.1).start()
    try:
        assert [w.worker_id for w in directory.live_workers()] == ["gone"]
        # No heartbeat: the lease lapses, and the directory's own thread drops the entries.
        wait_until(lambda: not index.blocks_of("gone"), 10, "the sweep of the lapsed worker")
        assert index.holders(11) == {}
        assert directory.live_workers() == ()
    finally:
        directory.stop()
