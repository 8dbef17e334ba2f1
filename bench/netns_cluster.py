"""pdserve over hosts with their own network (``netns_hosts.py``), started as a user starts it.

    head        `pdserve up --head --kv-backend tcp FLAGS`: Redis, Ray head, router(s)
    each other  `pdserve join HEAD --token-file F --name NAME FLAGS`

Every command runs from this checkout on its host, its output in ``NAME.log`` and its
endpoints in ``NAME.json`` under one directory. The head is an ``UpProcess`` (its pid is
`pdserve up` itself: ``ip netns exec`` execs it). KV goes over the TCP backend, the one
that authenticates each connection with the cluster's key. ``Lan.close`` stops them all.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.netns_hosts import Lan
from pdserve.bench.up_process import BASE_ARGS, REPO_ROOT, UpProcess

PDSERVE = (sys.executable, "-m", "pdserve.cluster.cli")
ENV = {
    "PYTHONPATH": str(REPO_ROOT),
    "PYTHONUNBUFFERED": "1",
    "PDSERVE_TORCH_THREADS": "1",
    "UCX_TLS": "tcp",  # the hosts share a kernel: keep UCX off shared memory
}
START_TIMEOUT_S = 900.0  # a cold start loads the model once per worker, on a busy machine


def launch_head(net: Lan, directory: Path, *flags: str, env: Mapping[str, str] = ENV) -> UpProcess:
    """`pdserve up --head` on the host "head", without waiting (``wait_serving`` does)."""
    state_file, log = directory / "head.json", directory / "head.log"
    command = (*PDSERVE, "up", "--head", "--name", "head", *BASE_ARGS, "--kv-backend", "tcp",
               *flags, "--state-file", str(state_file))  # fmt: skip
    return UpProcess(net.hosts["head"].popen(command, env, log), state_file, log)


def start_head(
    net: Lan, directory: Path, *flags: str, env: Mapping[str, str] = ENV
) -> dict[str, Any]:
    """`pdserve up --head` on the host "head", once serving: its state file."""
    head = launch_head(net, directory, *flags, env=env)
    head.wait_serving(START_TIMEOUT_S)
    return head.state


def join(
    net: Lan,
    directory: Path,
    head: Mapping[str, Any],
    name: str,
    *flags: str,
    env: Mapping[str, str] = ENV,
) -> None:
    """`pdserve join` on host ``name`` (wait for it with ``joined``)."""
    _, _, head_address, _, token_file, *_ = head["join_command"].split()
    command = (*PDSERVE, "join", head_address, "--token-file", token_file, "--name", name,
               *flags, "--state-file", str(directory / f"{name}.json"))  # fmt: skip
    net.hosts[name].popen(command, env, directory / f"{name}.log")


def joined(directory: Path, names: Sequence[str]) -> None:
    """Until each host's `pdserve join` has written its state file (its workers serve)."""
    for name in names:
        wait_for_state(directory / f"{name}.json", directory / f"{name}.log")


def wait_for_state(path: Path, log: Path) -> dict[str, Any]:
    deadline_s = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        text = log.read_text(errors="replace") if log.exists() else ""
        if "Traceback" in text or "error:" in text or time.monotonic() > deadline_s:
            raise RuntimeError(f"{path.name} never written; {log.name}:\n{text[-4000:]}")
        time.sleep(0.5)
    state: dict[str, Any] = json.loads(path.read_text())
    return state
