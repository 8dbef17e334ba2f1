"""`pdserve up` as a child process of a benchmark: start, wait until serving, stop, no orphans.

The child runs ``python -m pdserve.cluster.cli up`` from the repository root (so Ray's workers
import this checkout) with its output in a log file, and gets PR_SET_PDEATHSIG: if the benchmark
dies, the cluster gets SIGTERM and stops itself. ``stop`` sends SIGTERM, waits for the
cluster's own orderly shutdown (router, workers, Ray, Redis), then checks that nothing it
had started is still alive; stragglers are killed one by one, by pid, and reported.
The cluster tests (``tests/integration/cluster_proc.py``) launch it the same way, with
``kill_leftovers=False``: they check that SIGTERM alone leaves no orphan behind.
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
_PR_SET_PDEATHSIG = 1
BASE_ARGS = ("--http-port", "0", "--grpc-port", "0", "--no-dashboard")
START_TIMEOUT_S = 900.0  # a cold start loads the model once per worker, on a busy machine


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it (a clean stop) when the benchmark dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def terminate(
    process: subprocess.Popen[bytes], timeout_s: float, kill_wait_s: float = 10.0
) -> None:
    """SIGTERM ``process`` (a clean stop) and wait; SIGKILL it if it outlives ``timeout_s``."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(kill_wait_s)


@dataclass
class UpProcess:
    """A running `pdserve up`; ``state`` is its endpoints file once serving. With
    ``kill_leftovers`` False, ``stop`` leaves stragglers alone (for a test to find)."""

    process: subprocess.Popen[bytes]
    state_file: Path
    log_path: Path
    kill_leftovers: bool = True
    state: dict[str, Any] = field(default_factory=dict)
    orphans_killed: list[str] = field(default_factory=list)

    @property
    def http_url(self) -> str:
        return str(self.state["http"])

    @property
    def grpc_address(self) -> str:
        return str(self.state["grpc"])

    @property
    def redis_url(self) -> str:
        return str(self.state["redis_url"])

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run another pdserve command against this cluster (via its state file)."""
        command = [
            sys.executable,
            "-m",
            "pdserve.cluster.cli",
            *args,
            "--state-file",
            str(self.state_file),
        ]
        return subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
        )

    def status(self) -> dict[str, Any]:
        """`pdserve status --json`: the workers (role, worker_id, pid...) and pool counts."""
        out = self.cli("status", "--json")
        if out.returncode != 0:
            raise RuntimeError(f"pdserve status exited {out.returncode}: {out.stderr}")
        status: dict[str, Any] = json.loads(out.stdout)
        return status

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline_s = time.monotonic() + timeout_s
        while not self.state_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"pdserve up exited {self.process.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"pdserve up not serving in {timeout_s} s:\n{self.tail()}")
            time.sleep(0.5)
        self.state = json.loads(self.state_file.read_text())

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM and wait (SIGKILL after ``timeout_s``); then kill any process it left
        (unless ``kill_leftovers`` is off). Returns the exit code of `pdserve up`."""
        started = descendants(self.process.pid) if self.kill_leftovers else {}
        terminate(self.process, timeout_s, kill_wait_s=30.0)
        self.orphans_killed = _kill_leftovers(started)
        return self.process.returncode

    def tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start_up(
    work_dir: Path,
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    kill_leftovers: bool = True,
    new_session: bool = False,
) -> UpProcess:
    """Launch `pdserve up ARGS` (on free ports, no Ray dashboard) without waiting for it:
    workers load while the caller does other work. ``env`` adds to this process's.
    ``new_session``: in a session (and process group) of its own, as a shell runs a
    command, so that a signal to the group reaches what a terminal's Ctrl-C would."""
    work_dir.mkdir(parents=True, exist_ok=True)
    state_file, log_path = work_dir / "up.json", work_dir / "up.log"
    state_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pdserve.cluster.cli", "up", *BASE_ARGS, *args]
    command += ["--state-file", str(state_file)]
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            start_new_session=new_session,
        )
    return UpProcess(process, state_file, log_path, kill_leftovers)


@contextlib.contextmanager
def running_up(
    work_dir: Path, args: Sequence[str], env: Mapping[str, str], timeout_s: float
) -> Iterator[UpProcess]:
    """A serving cluster for the ``with`` block; stopped (and checked for orphans) after."""
    up = start_up(work_dir, args, env)
    try:
        up.wait_serving(timeout_s)
        yield up
    finally:
        up.stop()


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
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command may contain ')'
        children.setdefault(ppid, []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found[child] = _cmdline(child)
        todo += children.get(child, [])
    return found


def process_cores(root_pid: int, command_prefix: str) -> dict[int, list[int]]:
    """CPU cores each process below ``root_pid`` whose command starts with ``command_prefix``
    may run on (the union over its threads); shows that pinning took effect."""
    found: dict[int, list[int]] = {}
    for pid, cmdline in descendants(root_pid).items():
        if not cmdline.startswith(command_prefix):
            continue
        cores: set[int] = set()
        with contextlib.suppress(OSError):  # exited meanwhile
            for task in (Path("/proc") / str(pid) / "task").iterdir():
                cores |= os.sched_getaffinity(int(task.name))
        found[pid] = sorted(cores)
    return found


def alive(pid: int, cmdline: str | None = None) -> bool:
    """``pid`` has not exited (a zombie has: only its exit status is left) and, when
    ``cmdline`` is given, still runs it (not a new process that reuses the pid)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and (cmdline is None or _cmdline(pid) == cmdline)


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _kill_leftovers(started: Mapping[int, str], grace_s: float = 10.0) -> list[str]:
    """Wait up to ``grace_s`` for ``started`` processes to end; SIGKILL the rest by pid."""
    deadline_s = time.monotonic() + grace_s
    left = {p: c for p, c in started.items() if alive(p, c)}
    while left and time.monotonic() < deadline_s:
        time.sleep(0.2)
        left = {p: c for p, c in left.items() if alive(p, c)}
    for pid in left:
        with contextlib.suppress(ProcessLookupError):  # it ended after all
            os.kill(pid, signal.SIGKILL)
    return [f"{pid} {cmd[:120]}" for pid, cmd in left.items()]
