"""Real worker processes for integration tests: start on free loopback ports, stop cleanly.

Each worker is ``python -m pdserve.worker.server`` with ``--port 0``; it writes a ready file
(with the port it bound) once its model is loaded and warm. Given a cluster secret, a worker
serves mutual TLS and authenticated KV, and the test talks to it with the secret's
certificate. Children get PR_SET_PDEATHSIG,
so a test run that dies never leaves workers behind; ``stop`` sends SIGTERM, then SIGKILL.
Also: a client-side driver of the disaggregated path (ReserveKV -> Prefill -> Decode).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pdserve.bench.up_process import terminate
from pdserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.cluster_secret import ClusterSecret, write_secret_file
from pdserve.worker.mutual_tls import client_tls

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the test process dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class WorkerProc:
    """One started worker process and a channel to it."""

    name: str
    role: str
    process: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)
    secret: ClusterSecret | None = None
    _channel: grpc.Channel | None = None

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        if self._channel is None and self.secret is None:
            self._channel = grpc.insecure_channel(self.address)
        elif self._channel is None:
            tls = client_tls(self.secret)
            options = list(tls.options)
            self._channel = grpc.secure_channel(self.address, tls.credentials, options=options)
        return worker_pb2_grpc.WorkerStub(self._channel)

    def wait_ready(self, deadline_s: float) -> None:
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"worker {self.name} exited with {self.process.returncode} before it was "
                    f"ready; log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"worker {self.name} not ready in time:\n{self.log_tail()}")
            time.sleep(0.2)
        self.info = json.loads(self.ready_file.read_text())

    def stats(self) -> worker_pb2.WorkerStats:
        return self.stub.GetStats(worker_pb2.StatsRequest(), timeout=30)

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        terminate(self.process, timeout_s)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL now: a crashed worker."""
        self.process.kill()
        self.process.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def launch_worker(
    name: str, role: str, tmp_dir: Path, *extra: str, secret: ClusterSecret | None = None
) -> WorkerProc:
    """Start a worker without waiting for it (its model loads in the background); with
    ``secret`` (written to a 0600 file for it), as a member of that cluster."""
    ready = tmp_dir / f"{name}.ready.json"
    log_path = tmp_dir / f"{name}.log"
    args = [sys.executable, "-m", "pdserve.worker.server", "--role", role, "--port", "0"]
    args += ["--worker-id", name, "--ready-file", str(ready), *extra]
    if secret is not None:
        secret_file = tmp_dir / f"{name}.secret"
        write_secret_file(secret_file, secret)
        args += ["--cluster-secret-file", str(secret_file)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            args,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
    return WorkerProc(name, role, process, ready, log_path, secret=secret)


@contextlib.contextmanager
def running(workers: Sequence[WorkerProc]) -> Iterator[list[WorkerProc]]:
    """Wait until every worker is ready; stop them all on exit, whatever happened."""
    try:
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        for worker in workers:
            worker.wait_ready(deadline_s)
        yield list(workers)
    finally:
        for worker in workers:
            worker.stop()


# -- the disaggregated path, as the router drives it -----------------------------------


@dataclass
class DisaggResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    destination: worker_pb2.KVDestination
    report: worker_pb2.TransferReport | None


def greedy(max_tokens: int, **kw: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run_disaggregated(
    prefill: WorkerProc,
    decode: WorkerProc,
    request_id: str,
    prompt: Sequence[int],
    params: common_pb2.SamplingParams,
    transfer_timeout_s: float = 30.0,
    peer_prefix: worker_pb2.PeerPrefix | None = None,
) -> DisaggResult:
    """ReserveKV on ``decode``, Prefill on ``prefill`` (first token, then the report),
    Decode on ``decode``; like the router, but sequential. ``peer_prefix``: the prefill
    worker fetches that prefix from another prefill worker first."""
    reserve = decode.stub.ReserveKV(
        worker_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt), timeout=30
    )
    assert reserve.accepted, f"decode worker refused {request_id}"
    events = prefill.stub.Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            destination=reserve.destination,
            peer_prefix=peer_prefix,
        ),
        timeout=120,
    )
    first_event = next(events)
    assert first_event.HasField("first_token"), first_event
    first = first_event.first_token
    token_ids, text = list(first.token_ids), first.text
    if first.finish_reason:
        events.cancel()
        decode.stub.Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=30)
        return DisaggResult(token_ids, text, first.finish_reason, reserve.destination, None)
    report = next(events).transfer
    finish = ""
    decode_request = worker_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params,
        first_token=first,
        transfer_timeout_s=transfer_timeout_s,
    )
    for chunk in decode.stub.Decode(decode_request, timeout=120):
        token_ids += chunk.token_ids
        text += chunk.text
        finish = chunk.finish_reason or finish
    return DisaggResult(token_ids, text, finish, reserve.destination, report)


def run_generate(
    worker: WorkerProc, request_id: str, prompt: Sequence[int], params: common_pb2.SamplingParams
) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Token ids and text per sequence index of one Generate call."""
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    request = worker_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, params=params
    )
    for chunk in worker.stub.Generate(request, timeout=120):
        tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
        texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
    return tokens, texts


def wait_for(condition: Any, timeout_s: float = 30.0, interval_s: float = 0.1) -> bool:
    """Poll ``condition()`` until true or ``timeout_s``; returns its last value."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if condition():
            return True
        time.sleep(interval_s)
    return bool(condition())


@functools.cache
def offline_llm() -> Any:
    """One offline engine per test process (the reference the workers must equal)."""
    from pdserve.engine import LLM

    return LLM(num_blocks=256)
