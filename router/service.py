"""One router process: lifecycle + frontend + gRPC and HTTP servers, started and stopped together.

``cluster/`` builds the config, tokenizer, worker directory and locality index, then calls
``start_router``. Port 0 in the config picks a free port; the bound ports are reported.
"""

from __future__ import annotations

import asyncio
import math
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import uvicorn

from pdserve.router.config import RouterConfig
from pdserve.router.edge.frontend import Frontend
from pdserve.router.edge.grpc_server import start_grpc_server
from pdserve.router.edge.http_server import create_app
from pdserve.router.edge.tokenizer import Tokenizer
from pdserve.router.observe.dashboard import mount_observability
from pdserve.router.observe.observability import RouterObservability
from pdserve.router.request.lifecycle import RequestLifecycle
from pdserve.router.request.metered_lifecycle import MeteredLifecycle
from pdserve.router.request.types import TimingSink
from pdserve.router.state.directory import ChannelPool, WorkerDirectory
from pdserve.router.state.locality import LocalityIndex, PromptBlockHasher

if TYPE_CHECKING:
    from pdserve.worker.mutual_tls import ClientTls


@dataclass
class RouterService:
    lifecycle: RequestLifecycle
    frontend: Frontend
    grpc_server: grpc.aio.Server
    grpc_port: int
    http_server: uvicorn.Server
    http_port: int
    observability: RouterObservability
    _http_task: asyncio.Task[None]

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Stop taking requests, let running ones finish for ``grace_s``, close channels."""
        # uvicorn otherwise waits for every open HTTP stream to end, however long it runs
        # (it takes whole seconds).
        self.http_server.config.timeout_graceful_shutdown = math.ceil(grace_s or 0)
        self.http_server.should_exit = True
        await self.grpc_server.stop(grace_s)
        await self._http_task
        await self.observability.stop()
        await self.lifecycle.close()


async def start_router(
    config: RouterConfig,
    tokenizer: Tokenizer,
    directory: WorkerDirectory,
    locality: LocalityIndex | None = None,
    hasher: PromptBlockHasher | None = None,
    timing_sink: TimingSink | None = None,
    worker_tls: ClientTls | None = None,
) -> RouterService:
    """Start both servers on ``config.host``; ``worker_tls``: mutual TLS to the workers (a
    cluster with a secret), else plaintext."""
    channels = ChannelPool(worker_tls, config.max_message_bytes)
    obs = RouterObservability(config, directory, channels)
    # The tokenizer also decodes: exact text when a stream fails over.
    lifecycle = MeteredLifecycle(
        config, directory, channels, obs, locality, hasher, timing_sink, text_decoder=tokenizer
    )
    frontend = Frontend(config, tokenizer, lifecycle)
    grpc_server, grpc_port = await start_grpc_server(frontend, config)
    app = create_app(frontend, config)
    mount_observability(app, obs)
    sock = _listen(config.host, config.http_port, config.reuse_port)
    http_server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=config.tls_cert_path,
            ssl_keyfile=config.tls_key_path,
        )
    )
    http_task = asyncio.create_task(http_server.serve(sockets=[sock]))
    while not http_server.started:
        if http_task.done():
            await http_task  # raises what stopped it
            raise RuntimeError(f"HTTP server on {config.host}:{config.http_port} did not start")
        await asyncio.sleep(0.005)
    http_port = int(sock.getsockname()[1])
    obs.start()
    return RouterService(
        lifecycle, frontend, grpc_server, grpc_port, http_server, http_port, obs, http_task
    )


def _listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # several router processes accept on this port (router/processes.py)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock
