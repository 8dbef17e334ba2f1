"""Clean stops of `pdserve up` (1 prefill + 1 decode worker, two router processes): Ctrl-C as
a terminal sends it (SIGINT to the whole process group) and SIGTERM as Kubernetes or a
process manager sends it (to the main process).

Either way the stop runs in order: the routers stop admitting, the requests in flight (a
gRPC and an HTTP stream, far longer than the router's grace) end: finished, or cut after the
grace (gRPC: UNAVAILABLE; HTTP: the stream closes without ``[DONE]``). Then the workers drain
and deregister, Ray stops, and only then the embedded Redis. Checked from the outside: the
exit code and time, the streams' ends, the log (no "Redis unreachable", no failure, the
registry empty at exit and logged before Redis stopped) and no process left behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc
from tests.integration.cluster_proc import UpProcess, alive, descendants, start_up

pytestmark = pytest.mark.slow

# A bound on the whole stop, not a measurement: router grace (5 s), the workers' graceful
# stop (10 s at most), Ray and Redis, on a machine busy with other jobs.
STOP_WITHIN_S = 60.0
# Lines an orderly stop never logs: something stopped before a part that still used it.
OUT_OF_ORDER = ("unreachable", "failed", "still registered")
# uvicorn cuts an HTTP stream still open after the grace and logs it with a traceback; any
# other traceback is a failure.
HTTP_CUT = "CancelledError: Task cancelled, timeout graceful shutdown exceeded"
IN_ORDER = (
    "pdserve.up: workers stopped",
    "pdserve.up: Ray stopped",
    "pdserve.up: at exit every worker has deregistered",
    "pdserve.up: embedded redis-server stopped",
)
CUT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
MODEL = "smollm2-135m-instruct"


def _stream_until_stopped(address: str, first_token: threading.Event) -> tuple[str, str]:
    """A long greedy stream: ("finished", reason) or (status code name, details)."""
    request = inference_pb2.GenerateTextRequest(
        token_ids=inference_pb2.TokenIds(ids=[1, 2, 3, 4]),
        params=common_pb2.SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True),
    )
    finish = ""
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            for response in stub.Generate(request, timeout=300):
                first_token.set()
                finish = response.chunk.finish_reason or finish
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""
    return "finished", finish


def _http_stream_until_stopped(url: str, first_token: threading.Event) -> tuple[str, str]:
    """A long streamed completion: ("finished", "[DONE]") or ("cut", how it ended)."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4000, "stream": True,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    last = ""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    first_token.set()
                    last = line
    except httpx.HTTPError as err:
        return "cut", f"{type(err).__name__}: {err}"
    return ("finished", last) if last == "data: [DONE]" else ("cut", last[:200])


def _stop_phase(up: UpProcess) -> list[str]:
    lines = up.log_path.read_text(errors="replace").splitlines()
    start = next(i for i, line in enumerate(lines) if "Ctrl-C to stop." in line)
    return lines[start + 1 :]


@pytest.mark.parametrize("how", ["SIGINT to the process group", "SIGTERM to pdserve up"])
def test_pdserve_up_stops_in_order_within_its_bound(tmp_path: Path, how: str) -> None:
    up = start_up(
        tmp_path, *("--prefill", "1", "--decode", "1", "--router-processes", "2"), new_session=True
    )
    try:
        up.wait_serving()
        started = descendants(up.process.pid)
        assert any("redis-server" in cmd for cmd in started.values())
        grpc_started, http_started = threading.Event(), threading.Event()
        with ThreadPoolExecutor(2) as pool:
            grpc_stream = pool.submit(_stream_until_stopped, up.grpc_address, grpc_started)
            http_stream = pool.submit(_http_stream_until_stopped, up.http_url, http_started)
            assert grpc_started.wait(120) and http_started.wait(120), "a stream never started"
            signalled_s = time.monotonic()
            if how.startswith("SIGINT"):
                os.killpg(up.process.pid, signal.SIGINT)
            else:
                up.process.send_signal(signal.SIGTERM)
            code = up.process.wait(STOP_WITHIN_S)
            stopped_after_s = time.monotonic() - signalled_s
            grpc_end, http_end = grpc_stream.result(30), http_stream.result(30)
    finally:
        if up.process.poll() is None:
            up.stop()
    print(f"\n{how}: exit {code} after {stopped_after_s:.1f}s; gRPC {grpc_end}, HTTP {http_end}")
    assert code == 0, up.tail()
    assert grpc_end[0] == "finished" or (grpc_end[0] in {c.name for c in CUT_CODES} and grpc_end[1])
    assert http_end[0] in ("finished", "cut"), http_end
    stop_lines = _stop_phase(up)
    bad = [line for line in stop_lines if any(word in line for word in OUT_OF_ORDER)]
    assert not bad, "\n".join(bad)
    tracebacks = sum("Traceback" in line for line in stop_lines)
    assert tracebacks == sum(HTTP_CUT in line for line in stop_lines), "\n".join(stop_lines)
    missing = [m for m in IN_ORDER if not any(m in line for line in stop_lines)]
    assert not missing, f"not logged: {missing}\n" + "\n".join(stop_lines)
    positions = [next(i for i, ln in enumerate(stop_lines) if m in ln) for m in IN_ORDER]
    assert positions == sorted(positions), stop_lines
    deadline_s = time.monotonic() + 30
    while any(alive(p, c) for p, c in started.items()) and time.monotonic() < deadline_s:
        time.sleep(0.2)
    left = {p: c for p, c in started.items() if alive(p, c)}
    assert not left, f"left running: {left}"
    assert not up.state_file.exists()
