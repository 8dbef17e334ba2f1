"""`pdserve up --autoscale` on this machine: real Ray, Redis, workers and router.

A load of short prompts with long answers grows the decode pool; long prompts with short
answers grow the prefill pool; when the load stops both shrink back. Every request completes
with all its tokens (scale-in drains before it stops a worker). The profile is written by
hand so that this machine's small load needs two workers per pool; the cooldowns are cut to
seconds. The test prints the pool sizes over time.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator

import pytest

from pdserve.cluster.autoscale import CapacityProfile, DecodePoint
from pdserve.cluster.pool_control import PoolTargetStore
from pdserve.cluster.registry import WorkerRegistry
from pdserve.proto.redis_keys import RedisKeys
from tests.integration.cluster_proc import (
    UpProcess,
    grpc_generate,
    redis_client,
    start_up,
    wait_until,
)

pytestmark = pytest.mark.slow

# One worker: 300 prompt tokens/s; 20 output tokens/s at a batch of 4 within 100 ms ITL.
PROFILE = CapacityProfile(300.0, (DecodePoint(1, 10.0, 0.05), DecodePoint(4, 20.0, 0.09)), 4, 12.0)
AUTOSCALE_ARGS = (
    "--prefill", "1", "--decode", "1", "--autoscale",
    "--min-prefill", "1", "--max-prefill", "2", "--min-decode", "1", "--max-decode", "2",
    "--scale-up-cooldown-s", "1", "--scale-down-cooldown-s", "4", "--scale-down-after-s", "4",
)  # fmt: skip


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("autoscale_live")
    profile = tmp / "profile.json"
    profile.write_text(json.dumps({"model": "smollm2-135m-instruct", "profile": PROFILE.to_dict()}))
    proc = start_up(tmp, *AUTOSCALE_ARGS, "--profile", str(profile))
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.stop()


class Load:
    """``threads`` clients sending one request after another until stopped."""

    def __init__(self, up: UpProcess, threads: int, prompt_tokens: int, max_tokens: int) -> None:
        self.results: list[tuple[int, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._args = (up.grpc_address, prompt_tokens, max_tokens)
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, seed: int) -> None:
        address, prompt_tokens, max_tokens = self._args
        rng = random.Random(seed)
        while not self._stop.is_set():
            prompt = [rng.randrange(100, 40000) for _ in range(prompt_tokens)]
            try:
                result = grpc_generate(address, prompt, max_tokens, ignore_eos=True)
            except Exception as err:
                self.errors.append(repr(err))
                continue
            self.results.append((len(result.token_ids), result.finish_reason))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)


def test_pools_follow_the_load_with_no_request_lost(up: UpProcess) -> None:
    client = redis_client(up)
    keys = RedisKeys(str(up.state["key_prefix"]))
    registry = WorkerRegistry(client, keys, lease_s=5.0)
    store = PoolTargetStore(client, keys)
    start_s = time.monotonic()
    timeline: list[str] = []

    def sizes() -> tuple[int, int]:
        live = registry.list_workers()
        targets = store.stored()
        assert targets is not None
        timeline.append(
            f"{time.monotonic() - start_s:5.1f} s  targets prefill {targets.prefill} decode "
            f"{targets.decode}  live {sum(w.role == 'prefill' for w in live)} + "
            f"{sum(w.role == 'decode' for w in live)}"
        )
        return targets.prefill, targets.decode

    short = long = None
    try:
        short = Load(up, threads=3, prompt_tokens=8, max_tokens=24)
        wait_until(lambda: sizes()[1] == 2, 120, "the decode pool to grow to 2")
        assert sizes()[0] == 1, "short prompts must not grow the prefill pool"
        short.stop()
        long = Load(up, threads=2, prompt_tokens=400, max_tokens=2)
        wait_until(lambda: sizes()[0] == 2, 120, "the prefill pool to grow to 2")
        long.stop()
        wait_until(lambda: sizes() == (1, 1), 120, "both pools to shrink back to 1")
        wait_until(lambda: len(registry.list_workers()) == 2, 60, "the drained workers to go")
    finally:
        for load in (short, long):
            if load is not None:
                load.stop()
        print("\n".join(timeline[:: max(1, len(timeline) // 40)]))
    assert short is not None and long is not None
    for load, max_tokens in ((short, 24), (long, 2)):
        assert load.errors == [], load.errors[:5]
        assert load.results, "the load sent nothing"
        assert set(load.results) == {(max_tokens, "length")}, "a request lost tokens"
