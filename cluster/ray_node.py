"""The Ray node that `pdserve join` adds to a running cluster: ``ray start --block`` as a child.

Ray's worker processes, the actors included, run under this node's raylet; stopping the child
(SIGTERM) stops the raylet and its processes and removes the node from the cluster. The
child gets PR_SET_PDEATHSIG, so the node goes when `pdserve join` dies however it dies.
Never ``ray stop``: it stops every Ray process on the machine, other clusters' too.

Each node gets a temporary directory of its own (``--temp-dir``, removed when it stops):
Ray keeps the node's Unix sockets there, and two nodes of one cluster on one machine (hosts
in network namespaces, as the tests build them) must not share them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster.ray_pools import HOST_LABEL
from pdserve.cluster.redis_server import die_with_parent

STARTED_LINE = "Ray runtime started"  # what `ray start` prints once its node is up
# Ray's error type in what `ray start` prints when the head refuses the node's token.
TOKEN_REFUSED_MARK = "InvalidAuthToken"
# On SIGTERM the node first asks the head to drain it (30 s by default). Our workers have
# drained before the node stops; a bound keeps a head that does not answer (this host was
# cut off a while ago) from holding the leave up.
NODE_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "5"}


class TokenRefused(ValueError):
    """The head's Ray refused this node's token: the join token is wrong or stale. A
    ValueError, so the CLI says so in one line (it is the user's input that is wrong)."""


@dataclass(slots=True, frozen=True)
class RayNodeSpec:
    head_address: str  # the head's Ray (GCS) address, host:port
    node_ip_address: str  # this host's address, as the other nodes reach it
    host_name: str  # the node's pdserve.host label: pools place their workers by it
    num_cpus: int
    log_path: Path  # the node inherits this process's environment: Ray's auth variables

    def command(self, temp_dir: str) -> list[str]:
        return [
            sys.executable, "-m", "ray.scripts.scripts", "start",
            "--address", self.head_address, "--node-ip-address", self.node_ip_address,
            "--num-cpus", str(self.num_cpus), "--labels", f"{HOST_LABEL}={self.host_name}",
            "--temp-dir", temp_dir, "--disable-usage-stats", "--block",
        ]  # fmt: skip


class RayNode:
    def __init__(self, spec: RayNodeSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self._temp_dir: str | None = None

    def start(self, timeout_s: float = 120.0) -> RayNode:
        """Start the node and wait until it is part of the cluster; TokenRefused when the
        head refuses its token, RuntimeError with the end of its log when it fails
        otherwise or takes longer than ``timeout_s``."""
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        # short: Unix socket paths under it must stay within 107 bytes
        self._temp_dir = tempfile.mkdtemp(prefix=f"ray-{self.spec.host_name[:16]}-")
        with self.spec.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.spec.command(self._temp_dir),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **NODE_ENV},
                preexec_fn=die_with_parent,
            )
        deadline_s = time.monotonic() + timeout_s
        while STARTED_LINE not in self._log_text():
            if not self.alive:
                self.stop()  # removes its temporary directory
                raise self._exit_error()
            if time.monotonic() > deadline_s:
                self.stop()
                raise RuntimeError(f"the Ray node did not join {self.spec.head_address} in "
                                   f"{timeout_s} s:\n{self._log_text()[-3000:]}")  # fmt: skip
            time.sleep(0.2)
        return self

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the node stops its raylet and leaves), SIGKILL after ``timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def _exit_error(self) -> Exception:
        """Why `ray start` exited before its node was up."""
        text, head = self._log_text(), self.spec.head_address
        if TOKEN_REFUSED_MARK in text:
            return TokenRefused(
                f"the Ray head at {head} refused this host ({TOKEN_REFUSED_MARK}): the join "
                "token is wrong or stale (another cluster's, or from before the head's secret "
                "changed); copy the token file that the head's `pdserve up --head` wrote "
                f"(Ray's output: {self.spec.log_path})"
            )
        return RuntimeError(f"`ray start` to join {head} failed:\n{text[-3000:]}")

    def _log_text(self) -> str:
        return self.spec.log_path.read_text(errors="replace")
