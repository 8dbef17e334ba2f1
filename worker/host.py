"""Hosts one worker server in the current process (a Ray actor's), and registers it once it serves.

The server runs on a background thread with its own event loop, so the hosting process
(a Ray actor: methods on other threads, Ray's own signal handling) stays in control::

    WorkerHost.start() -> thread: gRPC server up (NOT_SERVING) -> load model -> warm up
                       -> SERVING -> register(info, callbacks) (router may route here now)
    WorkerHost.drain() -> registration stopped -> wait until no request is running
    WorkerHost.stop()  -> NOT_SERVING -> in-flight calls get grace_s -> KV released

``register`` is whoever lists the worker for the router: the cluster passes its Redis agent
(cluster/worker_agent.py), so the worker layer imports no registry.

It assembles worker/server.py's public pieces (argument parsing, ``build_roles``,
``WorkerServicer``) the way its ``serve()`` does, adding the registration.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.engine.model.registry import resolve_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.workers import WorkerInfo, WorkerRole
from pdserve.worker import server as ws
from pdserve.worker.cluster_secret import ClusterSecret
from pdserve.worker.engine_callbacks import (
    DrainFn,
    SnapshotFn,
    StatsFn,
    engine_callbacks,
    load_from_stats,
)
from pdserve.worker.metrics import MetricsServer
from pdserve.worker.mutual_tls import add_worker_port
from pdserve.worker.raw_requests import add_worker_service

log = logging.getLogger("pdserve.worker_host")
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """What to run: one worker's role, identity, model and server flags (picklable)."""

    role: str
    worker_id: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    kv_backend: str = "nixl"
    extra_args: tuple[str, ...] = ()  # more `python -m pdserve.worker.server` flags
    torch_threads: int = 1  # 0: torch's default
    grace_s: float = 5.0
    # Mutual TLS and authenticated KV (worker/server.py); shipped in memory, never as a flag.
    cluster_secret: ClusterSecret | None = field(default=None, repr=False)

    def server_args(self) -> list[str]:
        return [
            "--role", self.role, "--worker-id", self.worker_id, "--host", self.host,
            "--port", str(self.port), "--model", self.model, "--dtype", self.dtype,
            "--kv-backend", self.kv_backend, "--grace-s", str(self.grace_s),
            *self.extra_args,
        ]  # fmt: skip


class Registration(Protocol):
    """A worker's listing for the router, kept current until stopped."""

    @property
    def epoch(self) -> int: ...

    def stop(self, deregister: bool = True) -> None: ...


# Lists a serving worker (``info`` without epoch and load) and keeps it listed, reading the
# callbacks from its own thread; called on a worker thread, may block.
Register = Callable[[WorkerInfo, StatsFn, DrainFn, SnapshotFn], Registration]


@dataclass(slots=True, frozen=True)
class HostedWorker:
    """A worker that is serving and registered."""

    worker_id: str
    role: str
    address: str
    epoch: int
    pid: int
    metrics_url: str = ""  # the worker's Prometheus /metrics ("" when disabled)


class WorkerHost:
    def __init__(self, spec: WorkerSpec, register: Register) -> None:
        self.spec = spec
        self._register_fn = register
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._hosted: HostedWorker | None = None
        self._registration: Registration | None = None
        self._roles: ws.WorkerRoles | None = None
        self._metrics: MetricsServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="worker-host", daemon=True)

    def start(self) -> WorkerHost:
        if self.spec.torch_threads:
            import torch

            torch.set_num_threads(self.spec.torch_threads)
        self._thread.start()
        return self

    def wait_ready(self, timeout_s: float) -> HostedWorker:
        """Block until serving and registered; raises what stopped it, or TimeoutError."""
        deadline_s = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self._done.is_set():
                raise RuntimeError(
                    f"worker {self.spec.worker_id} stopped before it was ready: {self._error!r}"
                ) from self._error
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"worker {self.spec.worker_id} not ready in {timeout_s} s")
        assert self._hosted is not None, "ready without a hosted worker"
        return self._hosted

    @property
    def roles(self) -> ws.WorkerRoles | None:
        """The worker's engine and role services once its model is loaded (None before)."""
        return self._roles

    def run_on_loop(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the worker's event loop (where its services live); its result."""
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            raise RuntimeError(f"worker {self.spec.worker_id} is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def drain(self, timeout_s: float) -> int:
        """Deregister, then wait (up to ``timeout_s``) until no request runs here; returns
        the number still running when it gave up (0 = drained)."""
        if self._registration is not None:
            self._registration.stop(deregister=True)
        deadline_s = time.monotonic() + timeout_s
        busy = self._busy()
        while busy and time.monotonic() < deadline_s:
            time.sleep(0.1)
            busy = self._busy()
        return busy

    def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful stop (running calls get ``grace_s``); returns once the thread ended."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        self._done.wait(timeout_s)

    # -- the server thread ---------------------------------------------------------------
    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as err:
            self._error = err
            log.exception("worker %s failed", self.spec.worker_id)
        finally:
            self._done.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        args = ws.build_parser().parse_args(self.spec.server_args())
        configs = ws.configs_from_args(args, self.spec.cluster_secret)
        server_cfg, engine_cfg, transfer_cfg, decode_cfg = configs
        servicer = ws.WorkerServicer(server_cfg)
        health_servicer = health.aio.HealthServicer()
        server = _grpc_server(servicer, health_servicer)
        port = add_worker_port(server, f"{server_cfg.host}:{server_cfg.port}", server_cfg.secret)
        await server.start()
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            self._roles = await asyncio.to_thread(
                ws.build_roles, server_cfg, engine_cfg, transfer_cfg, decode_cfg
            )
            await _warm_up(self._roles)
            servicer.roles = self._roles
            self._metrics = ws.start_worker_metrics(server_cfg, self._roles)
            await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
            await self._register(f"{server_cfg.host}:{port}", engine_cfg.cache.block_size)
            await self._stop.wait()
        finally:
            await self._shutdown(server, health_servicer)

    async def _register(self, address: str, block_size: int) -> None:
        roles = self._roles
        assert roles is not None, "register before the roles were built"
        stats = await roles.engine.stats()
        info = WorkerInfo(
            worker_id=self.spec.worker_id,
            role=WorkerRole(self.spec.role),
            address=address,
            model=resolve_model(self.spec.model).model_id,
            kv_capacity_blocks=stats.total_blocks,
            block_size=block_size,
        )
        callbacks = engine_callbacks(roles.engine, asyncio.get_running_loop())
        self._registration = registration = await asyncio.to_thread(
            self._register_fn, info, *callbacks
        )
        metrics_url = self._metrics.url if self._metrics is not None else ""
        self._hosted = HostedWorker(
            info.worker_id, info.role.value, address, registration.epoch, os.getpid(), metrics_url
        )
        self._ready.set()
        log.info("worker %s serving at %s, epoch %d", info.worker_id, address, registration.epoch)

    async def _shutdown(self, server: grpc.aio.Server, health_servicer: Any) -> None:
        if self._registration is not None:
            await asyncio.to_thread(self._registration.stop, True)
        if self._metrics is not None:
            self._metrics.stop()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(self.spec.grace_s)
        if self._roles is not None:
            await self._roles.close()

    def _busy(self) -> int:
        loop, roles = self._loop, self._roles
        if loop is None or roles is None or loop.is_closed():
            return 0
        load = load_from_stats(self.run_on_loop(roles.engine.stats(), 10.0))
        held = dict(load.extra).get("held", 0.0)
        return load.running + load.waiting + int(held)


def _grpc_server(servicer: ws.WorkerServicer, health_servicer: Any) -> grpc.aio.Server:
    server = grpc.aio.server(options=ws.SERVER_OPTIONS)
    add_worker_service(server, servicer)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server


async def _set_health(servicer: Any, status: Any) -> None:
    for service in ("", ws.SERVICE_NAME):
        await servicer.set(service, status)


async def _warm_up(roles: ws.WorkerRoles) -> None:
    """Start the engine thread and the role's background work, then run one tiny request
    through the whole step path (as worker/server.py does) before reporting SERVING."""
    roles.engine.start()
    if roles.decode is not None:
        roles.decode.start()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    async for _ in roles.engine.generate(f"warmup-{os.getpid()}", [1] * 8, params):
        pass
