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
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from cluster.locality_index import LocalityIndex
from cluster.redis_keys import RedisKeys
from cluster.registry import WorkerRegistry
from engine.sampling_params import SamplingParams
from router.locality import engine_prompt_hasher
from tests.integration.cluster_proc import (
    UpProcess,
    alive,
    descendants,
    grpc_generate,
    redis_client,
    start_up,
    wait_until,
)
from tests.integration.worker_procs import offline_llm

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


def expected_ids(llm: Any, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
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
        return self.index().longest_prefix(hashes, [worker_id])[worker_id] == len(hashes)


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
    assert rds.index().longest_prefix(hashes, [victim]) == {victim: 0}
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
    long_tokens = 96
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
    with ThreadPoolExecutor(2) as pool:
        # Two long requests at once, on different decode workers (consecutive round-robin
        # turns), so whichever worker is drained has a request running.
        futures = [
            pool.submit(grpc_generate, up.grpc_address, ids, long_tokens, "round_robin")
            for ids in prompts
        ]
        wait_until(
            lambda: sum(w.load.running_requests for w in rds.registry.list_workers()) >= 2,
            30,
            "both requests to run",
        )
        out = up.cli("scale", "decode", "1")
        assert out.returncode == 0, out.stderr
        wait_until(lambda: len([w for w in rds.epochs() if w.startswith("decode")]) == 1, 30,
                   "a decode worker to deregister")  # fmt: skip
        results = [f.result(timeout=300) for f in futures]
    for ids, got in zip(prompts, results, strict=True):
        assert got.token_ids == expected_ids(reference, ids, long_tokens)
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
