"""Worker processes for bench/ttft_breakdown.py: a prefill, a decode and a colocated worker.

Each is ``python -m pdserve.worker.server`` on a free loopback port (``--port 0``), found
through its ``--ready-file`` once its model is loaded and warm. Children get
PR_SET_PDEATHSIG (they die with the benchmark) and may be pinned to one core each; on exit
every worker gets SIGTERM, then SIGKILL if it has not stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.bench.up_process import terminate
from pdserve.proto import worker_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 900.0
_PR_SET_PDEATHSIG = 1


@dataclass
class WorkerProcess:
    name: str
    process: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path
    channel: grpc.Channel | None = None

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        assert self.channel is not None, f"worker {self.name} is not ready yet"
        return worker_pb2_grpc.WorkerStub(self.channel)

    def wait_ready(self, deadline_s: float) -> None:
        while not self.ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline_s:
                raise RuntimeError(
                    f"worker {self.name} did not start (exit code {self.process.poll()}); "
                    f"see {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.2)
        address = json.loads(self.ready_file.read_text())["address"]
        self.channel = grpc.insecure_channel(address)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.channel is not None:
            self.channel.close()
        terminate(self.process, timeout_s)

    def _log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _child_setup(core: int | None) -> Callable[[], None]:
    def setup() -> None:  # runs in the child, before exec
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if core is not None:
            os.sched_setaffinity(0, {core})

    return setup


def launch(role: str, work_dir: Path, args: list[str], core: int | None) -> WorkerProcess:
    """Start one worker without waiting for it."""
    ready = work_dir / f"ttft-{role}.ready.json"
    ready.unlink(missing_ok=True)
    log_path = work_dir / f"ttft-{role}.log"
    command = [sys.executable, "-m", "pdserve.worker.server", "--role", role, "--port", "0"]
    command += ["--worker-id", f"ttft-{role}", "--ready-file", str(ready), *args]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=_child_setup(core),
        )
    return WorkerProcess(role, process, ready, log_path)


@contextlib.contextmanager
def start_workers(
    work_dir: Path, num_blocks: int, torch_threads: int, cores: Mapping[str, int | None]
) -> Iterator[dict[str, WorkerProcess]]:
    """A prefill, a decode (NIXL) and a colocated worker, ready; stopped on exit."""
    common = ["--kv-backend", "nixl", "--num-blocks", str(num_blocks), "--no-prefix-caching"]
    common += ["--torch-threads", str(torch_threads)]
    workers = [launch(role, work_dir, common, cores.get(role)) for role in cores]
    try:
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        for worker in workers:
            worker.wait_ready(deadline_s)
        yield {w.name: w for w in workers}
    finally:
        for worker in workers:
            worker.stop()
