"""`pdserve up --autoscale` on this machine: real Ray, Redis, workers and router.

A `pdserve bench` run of short prompts with long answers grows the decode pool; a run of long
prompts with short answers grows the prefill pool; when the load stops both shrink back.
Every request completes with all its tokens (scale-in drains before it stops a worker). The profile
is written by hand so that this machine's small load needs two workers per pool; the cooldowns are
cut to seconds. The test prints the pool sizes over time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cluster.autoscale import CapacityProfile, DecodePoint
from pdserve.cluster.pool_control import PoolTargetStore
from pdserve.cluster.registry import WorkerRegistry
from pdserve.proto.redis_keys import RedisKeys
from tests.integration.cluster_proc import (
    UpProcess,
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


class BenchLoad:
    """`pdserve bench` against the router: ``prompts`` requests of fixed lengths, at most
    ``concurrency`` at a time, as fast as they are served; all outcomes in a JSON file."""

    def __init__(self, up: UpProcess, out: Path, prompts: int, concurrency: int,
                 input_len: int, output_len: int) -> None:  # fmt: skip
        self.out = out
        self.output_len = output_len
        args = [
            sys.executable, "-m", "pdserve.bench", "--base-url", up.http_url,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--ignore-eos", "--temperature", "0",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--disable-tqdm", "--json", str(out),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def finish(self) -> list[dict[str, object]]:
        """Wait for the run; every request it sent, as recorded."""
        output = self.proc.communicate(timeout=600)[0].decode()
        assert self.proc.returncode == 0, output[-3000:]
        (run,) = json.loads(self.out.read_text())["runs"]
        requests: list[dict[str, object]] = run["requests"]
        return requests

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def test_pools_follow_the_load_with_no_request_lost(up: UpProcess) -> None:
    client = redis_client(up)
    keys = RedisKeys(str(up.state["key_prefix"]))
    registry = WorkerRegistry(client, keys, lease_s=5.0)
    store = PoolTargetStore(client, keys)
    start_s = time.monotonic()
    timeline: list[str] = []  # one line per change of the pools
    last = ""

    def sizes() -> tuple[int, int]:
        nonlocal last
        live = registry.list_workers()
        targets = store.stored()
        assert targets is not None
        state = (
            f"targets prefill {targets.prefill} decode {targets.decode}, serving "
            f"{sum(w.role == 'prefill' for w in live)} + {sum(w.role == 'decode' for w in live)}"
        )
        if state != last:
            timeline.append(f"{time.monotonic() - start_s:6.1f} s  {state}")
            last = state
        return targets.prefill, targets.decode

    tmp = up.state_file.parent
    short = long = None
    try:
        short = BenchLoad(up, tmp / "short.json", 60, 3, input_len=8, output_len=24)
        wait_until(lambda: sizes()[1] == 2, 120, "the decode pool to grow to 2")
        assert sizes()[0] == 1, "short prompts must not grow the prefill pool"
        served = short.finish()
        long = BenchLoad(up, tmp / "long.json", 40, 2, input_len=400, output_len=2)
        wait_until(lambda: sizes()[0] == 2, 120, "the prefill pool to grow to 2")
        served += long.finish()
        wait_until(lambda: sizes() == (1, 1), 120, "both pools to shrink back to 1")
        wait_until(lambda: len(registry.list_workers()) == 2, 60, "the drained workers to go")
        sizes()
    finally:
        for load in (short, long):
            if load is not None:
                load.stop()
        print("\n".join(timeline))
    failed = [r["error"] for r in served if not r["success"]]
    assert failed == [], failed[:5]
    assert len(served) == 100
    assert {r["output_tokens"] for r in served[:60]} == {24}, "a request lost tokens"
    assert {r["output_tokens"] for r in served[60:]} == {2}, "a request lost tokens"
