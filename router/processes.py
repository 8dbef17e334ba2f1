"""Several router processes serving the same gRPC and HTTP ports (SO_REUSEPORT).

One router process runs its Python on one core; past that, more processes scale it. The
kernel spreads new connections over the processes that share a port, so each client
connection (and every request on it) stays with one process::

    clients ──> :grpc_port / :http_port  (SO_REUSEPORT)
                   ├── process 0: this one (start_router_processes' caller)
                   ├── process 1: spawned child, built by the same factory
                   └── ...

Every process is a whole router built by ``factory(config)``: its own worker channels,
admission limit, local load counts, metrics and goodput figures (router/README.md lists
what that means). The factory must be picklable (a module-level function, or a
``functools.partial`` of one with picklable arguments): children are started with the
``spawn`` method and build their own tokenizer, directory and index from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from pdserve.router.config import RouterConfig
from pdserve.router.event_loop import LoopKind, run
from pdserve.router.service import RouterService

RouterFactory = Callable[[RouterConfig], Awaitable[RouterService]]
CHILD_GRACE_S = 5.0  # a child stopped by SIGTERM lets running requests finish this long


@dataclass(slots=True, frozen=True)
class ChildReady:
    """What a child reports once both its servers accept connections."""

    pid: int
    grpc_port: int
    http_port: int


@dataclass
class RouterProcesses:
    """The caller's own router plus its children; ``stop`` ends them all."""

    service: RouterService
    children: list[BaseProcess]
    # Our ends of the pipes to the children: open while we live. A child stops when it
    # reads EOF, so that no router outlives its parent.
    links: list[Connection] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [os.getpid(), *(c.pid for c in self.children if c.pid is not None)]

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Stop every process; ``grace_s`` as in ``RouterService.stop`` (None: at once).

        Children get SIGTERM and let running requests finish for ``CHILD_GRACE_S``.
        """
        for child in self.children:
            if child.is_alive() and child.pid is not None:
                os.kill(child.pid, signal.SIGTERM)
        await self.service.stop(grace_s)
        await asyncio.to_thread(_join_all, self.children, CHILD_GRACE_S + 10.0)
        for link in self.links:
            link.close()


async def start_router_processes(
    config: RouterConfig,
    factory: RouterFactory,
    processes: int,
    loop: LoopKind = "auto",
    ready_timeout_s: float = 120.0,
) -> RouterProcesses:
    """``processes`` routers on ``config``'s ports: this process and ``processes - 1``
    children. Port 0 picks free ports once, here; the children bind the same ones."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    service = await factory(replace(config, reuse_port=processes > 1))
    group = RouterProcesses(service, [])
    try:
        await spawn_routers(group, config, factory, processes - 1, loop, ready_timeout_s)
    except BaseException:
        await group.stop(grace_s=None)
        raise
    return group


async def spawn_routers(
    group: RouterProcesses,
    config: RouterConfig,
    factory: RouterFactory,
    count: int,
    loop: LoopKind = "auto",
    ready_timeout_s: float = 120.0,
) -> None:
    """Add ``count`` child routers to ``group``, on the ports its own service bound (which
    must have been started with ``reuse_port``, else a child fails to bind and this
    raises). The caller stops ``group`` on failure."""
    shared = replace(
        config,
        grpc_port=group.service.grpc_port,
        http_port=group.service.http_port,
        reuse_port=True,
    )
    for index in range(1, count + 1):
        child, conn = _spawn(factory, _child_config(shared, index), loop)
        group.children.append(child)
        group.links.append(conn)
        ready = await asyncio.to_thread(_wait_ready, child, conn, ready_timeout_s)
        assert (ready.grpc_port, ready.http_port) == (shared.grpc_port, shared.http_port), (
            f"router process {ready.pid} bound {ready.grpc_port}/{ready.http_port}, "
            f"not the shared {shared.grpc_port}/{shared.http_port}"
        )


def _child_config(config: RouterConfig, index: int) -> RouterConfig:
    """A child's config: an explicit goodput router id gets a per-process suffix, so the
    processes do not overwrite each other's figures in Redis (the default id has the pid)."""
    if not config.slo.router_id:
        return config
    return replace(config, slo=replace(config.slo, router_id=f"{config.slo.router_id}-p{index}"))


def _spawn(
    factory: RouterFactory, config: RouterConfig, loop: LoopKind
) -> tuple[BaseProcess, Connection]:
    context = multiprocessing.get_context("spawn")  # fork would copy gRPC's threads' state
    ours, theirs = context.Pipe()
    child = context.Process(
        target=_child_main, args=(factory, config, theirs, loop), name="pdserve-router"
    )
    child.start()
    theirs.close()  # the child holds its end; EOF on ours means it died
    return child, ours


def _wait_ready(child: BaseProcess, conn: Connection, timeout_s: float) -> ChildReady:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"router process {child.pid} not ready after {timeout_s} s")
    try:
        message = conn.recv()
    except EOFError as err:
        child.join(1.0)
        raise RuntimeError(
            f"router process {child.pid} exited (code {child.exitcode}) before it was ready"
        ) from err
    assert isinstance(message, ChildReady), f"unexpected message from a router: {message!r}"
    return message


def _join_all(children: list[BaseProcess], timeout_s: float) -> None:
    for child in children:
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
            child.join(5.0)


def _child_main(
    factory: RouterFactory, config: RouterConfig, conn: Connection, loop: LoopKind
) -> None:
    run(_serve_child(factory, config, conn), loop)


async def _serve_child(factory: RouterFactory, config: RouterConfig, conn: Connection) -> None:
    """Serve until SIGTERM/SIGINT, or until the parent goes away (EOF on ``conn``)."""
    service = await factory(config)
    stop = asyncio.Event()
    running = asyncio.get_running_loop()
    # After the factory: uvicorn installs handlers of its own when its server starts.
    for signum in (signal.SIGTERM, signal.SIGINT):
        running.add_signal_handler(signum, stop.set)
    conn.send(ChildReady(os.getpid(), service.grpc_port, service.http_port))
    running.add_reader(conn.fileno(), stop.set)  # readable = EOF: the parent is gone
    try:
        await stop.wait()
    finally:
        running.remove_reader(conn.fileno())
        with contextlib.suppress(OSError):
            conn.close()
        await service.stop(grace_s=CHILD_GRACE_S)
