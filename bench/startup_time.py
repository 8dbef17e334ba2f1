"""Time from `pdserve up` to the first answered request, with where the time goes.

    python -m pdserve.bench.startup_time [--runs 1] [--prefill 1 --decode 1] [-- extra `up` flags]

Each run launches ``python -m pdserve.cluster.cli up`` as a user would (fresh process, local Ray,
embedded Redis, workers as Ray actors loading the real model), polls for its state file,
sends one greedy OpenAI completion (8 tokens) over HTTP, then stops it with SIGTERM and
times that too. Phases come from the launcher's own log lines (timestamps to the ms):

    launch -> Ray + Redis up ("starting ... worker")        ray_redis_s
           -> every worker loaded, warm, registered ("ready") workers_s
           -> router serving, endpoints written (state file)  router_s
           -> first completion answered (after GET /v1/models)  first_request_s
    total = launch -> first answer;  stop = SIGTERM -> process exit (everything torn down)

It talks to the cluster like a client (HTTP) and imports nothing of pdserve.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO pdserve\.pools: (.*)$")


@dataclass(slots=True, frozen=True)
class StartupRun:
    ray_redis_s: float
    workers_s: float
    router_s: float
    first_request_s: float
    total_s: float
    stop_s: float


def run_once(up_args: list[str], timeout_s: float) -> StartupRun:
    with tempfile.TemporaryDirectory(prefix="pdserve-startup-") as tmp:
        state = Path(tmp) / "up.json"
        log = Path(tmp) / "up.log"
        command = [sys.executable, "-m", "pdserve.cluster.cli", "up", "--http-port", "0"]
        command += ["--grpc-port", "0", "--state-file", str(state), *up_args]
        launched_wall = time.time()
        launched = time.monotonic()
        with log.open("wb") as out:
            proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            serving = _wait_for_file(state, proc, launched + timeout_s, log)
            answered = _first_answer(json.loads(state.read_text())["http"])
        finally:
            stop_s = _stop(proc)
        starting_wall, ready_wall = _phase_stamps(log.read_text(errors="replace"))
    return StartupRun(
        ray_redis_s=starting_wall - launched_wall,
        workers_s=ready_wall - starting_wall,
        router_s=(serving - launched) - (ready_wall - launched_wall),
        first_request_s=answered - serving,
        total_s=answered - launched,
        stop_s=stop_s,
    )


def _wait_for_file(path: Path, proc: subprocess.Popen[bytes], deadline: float, log: Path) -> float:
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"pdserve up did not come up (exit {proc.returncode}):\n{tail}")
        time.sleep(0.05)
    return time.monotonic()


def _first_answer(http_url: str) -> float:
    models = httpx.get(f"{http_url}/v1/models", timeout=60.0)
    models.raise_for_status()
    model = models.json()["data"][0]["id"]
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{http_url}/v1/completions", json=body, timeout=120.0)
    response.raise_for_status()
    assert response.json()["choices"][0]["text"], "empty completion"
    return time.monotonic()


def _stop(proc: subprocess.Popen[bytes]) -> float:
    started = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return time.monotonic() - started


def _phase_stamps(log_text: str) -> tuple[float, float]:
    """Wall times of the first "starting ... worker" and the last "... ready" lines."""
    starting: list[float] = []
    ready: list[float] = []
    for line in log_text.splitlines():
        match = _STAMP.match(line)
        if match:
            stamp = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if match[2].startswith("starting "):
                starting.append(stamp)
            elif " ready at " in match[2]:
                ready.append(stamp)
    assert starting and ready, "the launcher's log lacks its worker start/ready lines"
    return min(starting), max(ready)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    p.add_argument("up_args", nargs="*", help="more `pdserve up` flags (after --)")
    args = p.parse_args(argv)
    up_args = ["--prefill", str(args.prefill), "--decode", str(args.decode), *args.up_args]
    runs = [run_once(up_args, args.timeout_s) for _ in range(args.runs)]
    for run in runs:
        print(json.dumps(asdict(run)) if args.json else _line(run))
    if len(runs) > 1:
        print(f"total_s median {statistics.median(r.total_s for r in runs):.1f}")
    print(f"machine: {os.cpu_count()} CPUs; workers: {args.prefill} prefill + {args.decode} decode")
    return 0


def _line(run: StartupRun) -> str:
    return (
        f"first answer after {run.total_s:.1f} s = Ray+Redis {run.ray_redis_s:.1f} + workers "
        f"{run.workers_s:.1f} + router {run.router_s:.1f} + request {run.first_request_s:.2f}; "
        f"stop {run.stop_s:.1f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
