"""Several router processes on one pair of ports (SO_REUSEPORT), with a STUB worker.

The children are real spawned processes on the default event loop (uvloop when installed),
serving real gRPC and HTTP connections on loopback.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import signal
import socket
import threading
import urllib.request
from collections.abc import Awaitable, Iterator
from typing import TypeVar

import grpc
import pytest

from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc
from pdserve.proto.workers import WorkerInfo, WorkerRole
from pdserve.router.config import RouterConfig
from pdserve.router.event_loop import run
from pdserve.router.processes import RouterProcesses, start_router_processes
from pdserve.router.service import RouterService, start_router
from pdserve.router.state.directory import StaticWorkerDirectory
from tests.integration.stub_worker import (
    FakeCharTokenizer,
    StubWorker,
    router_for_stubs,
    start_stub_worker,
)

T = TypeVar("T")


class LoopThread:
    """An event loop in a thread; ``run`` blocks on a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout_s: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[LoopThread, StubWorker, str]]:
    thread = LoopThread()
    server, address, servicer = thread.run(start_stub_worker("w0", "colocated"))
    yield thread, servicer, address
    thread.run(server.stop(None))
    thread.close()


def start_group(stub: tuple[LoopThread, StubWorker, str], processes: int) -> RouterProcesses:
    """``processes`` routers on fresh ports in front of the stub worker."""
    thread, _, address = stub
    infos = (WorkerInfo("w0", WorkerRole.COLOCATED, address),)
    factory = functools.partial(router_for_stubs, infos)
    config = RouterConfig(grpc_port=0, http_port=0)
    return thread.run(start_router_processes(config, factory, processes))


@pytest.fixture(scope="module")
def group(stub: tuple[LoopThread, StubWorker, str]) -> Iterator[RouterProcesses]:
    processes = start_group(stub, 2)
    yield processes
    stub[0].run(processes.stop(grace_s=None))


def generate(grpc_port: int, text: str) -> str:
    """One request over a connection of its own (the kernel picks a process per connection)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateTextRequest(
            text=text, params=common_pb2.SamplingParams(max_tokens=3)
        )
        return "".join(r.chunk.text for r in stub.Generate(request, timeout=30))


def test_every_process_binds_the_same_ports_and_requests_are_served(
    group: RouterProcesses,
) -> None:
    service = group.service
    assert service.grpc_port != 0 and service.http_port != 0  # port 0 was resolved once
    assert len(set(group.pids)) == 2 and all(c.is_alive() for c in group.children)
    assert [generate(service.grpc_port, f"q{i}") for i in range(8)] == [" w0 w1 w2"] * 8
    body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{service.http_port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.load(response)["choices"][0]["text"] == " w0 w1"


def test_a_child_serves_the_ports_when_the_parent_router_stops(
    stub: tuple[LoopThread, StubWorker, str],
) -> None:
    thread = stub[0]
    processes = start_group(stub, 2)
    try:
        port = processes.service.grpc_port
        thread.run(processes.service.stop(None))  # only the child listens now
        assert generate(port, "after") == " w0 w1 w2"
    finally:
        thread.run(processes.stop(grace_s=None))
    assert all(not c.is_alive() for c in processes.children)


def test_a_child_killed_leaves_the_ports_to_the_others(
    stub: tuple[LoopThread, StubWorker, str],
) -> None:
    # kill -9 closes the child's listening sockets with it: every new connection goes to a
    # process still alive, so clients' next requests (and retries) are all served.
    thread = stub[0]
    processes = start_group(stub, 3)
    try:
        child = processes.children[0]
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        port = processes.service.grpc_port
        assert [generate(port, f"after {i}") for i in range(8)] == [" w0 w1 w2"] * 8
    finally:
        thread.run(processes.stop(grace_s=None))


def test_a_child_stops_when_its_parent_goes_away(
    stub: tuple[LoopThread, StubWorker, str],
) -> None:
    thread = stub[0]
    processes = start_group(stub, 2)
    try:
        child = processes.children[0]
        processes.links[0].close()  # what the parent dying looks like from the child
        child.join(30)
        assert child.exitcode == 0, f"child exit code {child.exitcode}"
    finally:
        thread.run(processes.stop(grace_s=None))


def test_one_process_starts_no_child_and_keeps_the_port_exclusive(
    stub: tuple[LoopThread, StubWorker, str],
) -> None:
    thread, _, address = stub
    infos = (WorkerInfo("w0", WorkerRole.COLOCATED, address),)
    processes = start_group(stub, 1)
    try:
        assert processes.children == [] and processes.pids == [os.getpid()]
        taken = RouterConfig(grpc_port=processes.service.grpc_port, http_port=_free_port())
        with pytest.raises(RuntimeError, match=r"[Ff]ailed to bind"):
            thread.run(start_router(taken, FakeCharTokenizer(), StaticWorkerDirectory(infos)))
    finally:
        thread.run(processes.stop(grace_s=None))
    with pytest.raises(ValueError, match="processes must be >= 1"):
        start_group(stub, 0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_child_that_fails_to_start_is_reported(
    stub: tuple[LoopThread, StubWorker, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    thread, _, address = stub
    monkeypatch.setenv(PARENT_PID_VARIABLE, str(os.getpid()))  # children inherit it
    infos = (WorkerInfo("w0", WorkerRole.COLOCATED, address),)
    factory = functools.partial(_parent_only_router, infos)
    config = RouterConfig(grpc_port=0, http_port=0)
    with pytest.raises(RuntimeError, match=r"exited \(code 1\) before it was ready"):
        thread.run(start_router_processes(config, factory, processes=2))


PARENT_PID_VARIABLE = "PDSERVE_TEST_ROUTER_PARENT_PID"


async def _parent_only_router(infos: tuple[WorkerInfo, ...], config: RouterConfig) -> RouterService:
    """A factory that works in the test process and fails in every child."""
    if os.environ.get(PARENT_PID_VARIABLE) != str(os.getpid()):
        raise RuntimeError(f"router child {os.getpid()} refuses to start (as the test wants)")
    return await router_for_stubs(infos, config)


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
def test_a_router_serves_on_uvloop(stub: tuple[LoopThread, StubWorker, str]) -> None:
    """grpc.aio hooks its completion queue into the loop's reader API: check it on uvloop
    (router children run on the default loop, uvloop when installed)."""
    _, _, address = stub
    infos = (WorkerInfo("w0", WorkerRole.COLOCATED, address),)

    async def serve_one() -> tuple[str, str]:
        service = await router_for_stubs(infos, RouterConfig(grpc_port=0, http_port=0))
        try:
            text = await asyncio.to_thread(generate, service.grpc_port, "uv")
        finally:
            await service.stop(None)
        return text, type(asyncio.get_running_loop()).__module__

    text, loop_module = run(serve_one(), "uvloop")
    assert text == " w0 w1 w2" and loop_module.startswith("uvloop")
