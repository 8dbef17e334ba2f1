"""`pdserve up` as a real child process for the cluster tests, and ways to talk to it.

The child runs ``python -m cluster.cli up`` from the repository root (so Ray's workers
import this checkout), gets PR_SET_PDEATHSIG, and writes its endpoints to a state file once
serving. ``descendants`` lists its whole process tree (Redis, Ray's daemons, the worker
actors), which is how a test proves that SIGTERM leaves no orphan behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis

from pdserve_proto import common_pb2, inference_pb2, inference_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 900.0
# Small KV pools: several workers share this machine's memory with other test jobs.
BASE_ARGS = ("--http-port", "0", "--grpc-port", "0", "--no-dashboard", "--num-blocks", "256")


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: stop cleanly with the tests


@dataclass
class UpProcess:
    process: subprocess.Popen[bytes]
    state_file: Path
    log_path: Path
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def http_url(self) -> str:
        return str(self.state["http"])

    @property
    def grpc_address(self) -> str:
        return str(self.state["grpc"])

    @property
    def redis_url(self) -> str:
        return str(self.state["redis_url"])

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.state_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"pdserve up exited {self.process.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pdserve up not serving in {timeout_s} s:\n{self.tail()}")
            time.sleep(0.5)
        self.state = json.loads(self.state_file.read_text())

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run another pdserve command against this cluster (via its state file)."""
        command = [sys.executable, "-m", "cluster.cli", *args, "--state-file", str(self.state_file)]
        return subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
        )

    def status(self) -> dict[str, Any]:
        out = self.cli("status", "--json")
        assert out.returncode == 0, out.stderr
        status: dict[str, Any] = json.loads(out.stdout)
        return status

    def stop(self, timeout_s: float = 120.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        return self.process.returncode

    def tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start_up(tmp_dir: Path, *args: str) -> UpProcess:
    """Launch `pdserve up` (not waiting: workers load while the caller does other work)."""
    state_file = tmp_dir / "up.json"
    log_path = tmp_dir / "up.log"
    command = [sys.executable, "-m", "cluster.cli", "up", *BASE_ARGS, *args]
    command += ["--state-file", str(state_file)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_TORCH_THREADS": "1"}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
    return UpProcess(process, state_file, log_path)


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid`` (pid -> command line), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found[child] = cmdline(child)
        todo += children.get(child, [])
    return found


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its exit status is left


@dataclass(frozen=True)
class GrpcResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill_worker: str
    decode_worker: str


def grpc_generate(
    address: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    policy: str = "",
    timeout_s: float = 120.0,
) -> GrpcResult:
    """Greedy generation through the router's gRPC API, from token ids."""
    request = inference_pb2.GenerateTextRequest(
        token_ids=inference_pb2.TokenIds(ids=list(prompt_token_ids)),
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        routing_policy=policy,
    )
    token_ids: list[int] = []
    text, finish, prefill, decode = "", "", "", ""
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for response in stub.Generate(request, timeout=timeout_s):
            token_ids += response.chunk.token_ids
            text += response.chunk.text
            finish = response.chunk.finish_reason or finish
            prefill = response.prefill_worker or prefill
            decode = response.decode_worker or decode
    return GrpcResult(token_ids, text, finish, prefill, decode)


def redis_client(up: UpProcess) -> redis.Redis:
    return redis.Redis.from_url(up.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except (redis.RedisError, OSError):
            pass  # the thing we wait for may be restarting
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)
