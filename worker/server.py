"""One worker process: engine + KV connector + the Worker gRPC service for one role.

    python -m pdserve.worker.server --role prefill|decode|colocated --port N \\
        [--model M] [--kv-backend nixl|tcp] [--ready-file PATH] ...

With ``--cluster-secret-file`` the gRPC port serves only mutual TLS under the cluster's CA
(worker/mutual_tls.py) and KV arrives only over authenticated connections (the TCP handshake
of kv_transfer/handshake.py); without it, both are open to whoever reaches them.

The server answers at once (health NOT_SERVING) and turns SERVING when the model is loaded
and warm; ``--ready-file`` then gets ``{"port", "worker_id", "epoch", "pid", ...}``. From
then on it also serves Prometheus ``/metrics`` (its GetStats figures) on ``--metrics-port``
(0: a free port, in the ready file as ``metrics_port``; -1: none). Every
role serves Generate (colocated serving, and the router's recompute fallback), Cancel and
GetStats; Prefill needs the prefill role, ReserveKV/Decode the decode role. SIGTERM stops
gracefully: NOT_SERVING, in-flight calls get ``--grace-s``, held KV is released.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.decode_worker.config import DecodeConfig
from pdserve.decode_worker.service import DecodeService
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.device_options import add_device_arguments, device_settings
from pdserve.engine.kv_cache.tier_options import (
    add_kv_cache_dtype_argument,
    add_kv_tier_arguments,
    kv_tier_settings,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.options import add_speculative_arguments, speculative_config
from pdserve.kv_transfer import FaultInjection, TransferConfig
from pdserve.prefill_worker.prefill import PrefillService
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker.cluster_secret import ClusterSecret, read_secret_file
from pdserve.worker.colocated import GenerateService
from pdserve.worker.convert import stats_to_proto
from pdserve.worker.errors import status_for
from pdserve.worker.metrics import MetricsServer, start_metrics_server, stats_fn_on_loop
from pdserve.worker.mutual_tls import add_worker_port, worker_channel_factory
from pdserve.worker.raw_requests import add_worker_service

log = logging.getLogger("pdserve.worker")
T = TypeVar("T")

ROLES = ("prefill", "decode", "colocated")
SERVICE_NAME = "pdserve.v1.Worker"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # NIXL agent metadata and long prompts fit easily
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Routers ping every few seconds while a call is open, also while a long prefill sends
    # nothing, to notice a host that was cut off: accept those pings (gRPC's default
    # answers more than one per 5 minutes without data with GOAWAY).
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


@dataclass(slots=True, frozen=True)
class WorkerServerConfig:
    role: str
    worker_id: str
    epoch: int
    host: str = "127.0.0.1"
    port: int = 0
    kv_backend: str = "nixl"
    ready_file: str | None = None
    grace_s: float = 5.0
    torch_threads: int | None = None
    metrics_port: int = 0  # Prometheus /metrics: 0 = a free port, -1 = none
    secret: ClusterSecret | None = field(default=None, repr=False)  # None: no mutual TLS

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 <= self.epoch < 2**32:
            raise ValueError(f"epoch must fit in uint32, got {self.epoch}")


@dataclass(slots=True)
class WorkerRoles:
    """What one worker serves: every role has the engine and Generate."""

    engine: AsyncEngine
    generate: GenerateService
    prefill: PrefillService | None = None
    decode: DecodeService | None = None

    async def cancel(self, request_id: str) -> bool:
        if self.prefill is not None:
            return await self.prefill.cancel(request_id)
        if self.decode is not None:
            return await self.decode.cancel(request_id)
        return await self.engine.abort(request_id)

    async def stats(self, config: WorkerServerConfig) -> worker_pb2.WorkerStats:
        role = self.prefill or self.decode
        transfer = role.transfer_stats() if role is not None else None
        msg = stats_to_proto(
            await self.engine.stats(),
            transfer,
            worker_id=config.worker_id,
            role=config.role,
            epoch=config.epoch,
        )
        if self.prefill is not None:
            self.prefill.peer_stats.fill(msg)
        return msg

    async def close(self) -> None:
        for service in (self.prefill, self.decode):
            if service is not None:
                await service.close()
        self.engine.close()


def build_roles(
    config: WorkerServerConfig,
    engine_config: EngineConfig,
    transfer_config: TransferConfig,
    decode_config: DecodeConfig,
) -> WorkerRoles:
    """Load the model and set up the KV connector (blocking; run it off the event loop)."""
    from pdserve.engine.engine import LLMEngine  # torch: only in the process that serves

    engine = AsyncEngine(LLMEngine(engine_config))
    roles = WorkerRoles(engine, GenerateService(engine))
    backend = config.kv_backend
    if config.role == "prefill":
        connect = worker_channel_factory(config.secret)
        roles.prefill = PrefillService.create(
            engine, config.worker_id, backend, transfer_config, connect
        )
    elif config.role == "decode":
        roles.decode = DecodeService.create(
            engine, config.worker_id, backend, transfer_config, decode_config
        )
    return roles


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Delegates each RPC to the role's handlers; maps their errors to status codes."""

    def __init__(self, config: WorkerServerConfig) -> None:
        self.config = config
        self.roles: WorkerRoles | None = None  # set once the model is loaded and warm

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        roles = await self._ready(context)
        stream = roles.generate.generate(request)
        async for chunk in self._guard(context, "Generate", request.request_id, stream):
            yield chunk

    async def Prefill(self, request: Any, context: Any) -> AsyncIterator[Any]:
        prefill = (await self._ready(context)).prefill
        if prefill is None:
            await self._wrong_role(context, "Prefill", "prefill")
            return
        stream = prefill.prefill(request)
        async for event in self._guard(context, "Prefill", request.request_id, stream):
            yield event

    async def ReserveKV(self, request: Any, context: Any) -> Any:
        decode = (await self._ready(context)).decode
        if decode is None:
            return await self._wrong_role(context, "ReserveKV", "decode")
        try:
            return await decode.reserve_kv(request)
        except Exception as exc:
            return await self._abort(context, "ReserveKV", request.request_id, exc)

    async def FetchKV(self, request: Any, context: Any) -> Any:
        prefill = (await self._ready(context)).prefill
        if prefill is None:
            return await self._wrong_role(context, "FetchKV", "prefill")
        try:
            return await prefill.fetch_kv(request)
        except Exception as exc:
            return await self._abort(context, "FetchKV", request.request_id, exc)

    async def Decode(self, request: Any, context: Any) -> AsyncIterator[Any]:
        decode = (await self._ready(context)).decode
        if decode is None:
            await self._wrong_role(context, "Decode", "decode")
            return
        stream = decode.decode(request)
        async for chunk in self._guard(context, "Decode", request.request_id, stream):
            yield chunk

    async def Cancel(self, request: Any, context: Any) -> Any:
        roles = await self._ready(context)
        found = await roles.cancel(request.request_id)
        log.info("cancel %s: %s", request.request_id, "freed" if found else "not found")
        return worker_pb2.CancelResponse(found=found)

    async def GetStats(self, request: Any, context: Any) -> Any:
        roles = await self._ready(context)
        return await roles.stats(self.config)

    async def _ready(self, context: Any) -> WorkerRoles:
        if self.roles is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {self.config.worker_id} is still loading its model; retry shortly",
            )
        assert self.roles is not None, "context.abort raises"
        return self.roles

    async def _guard(
        self, context: Any, method: str, request_id: str, stream: AsyncIterator[T]
    ) -> AsyncIterator[T]:
        try:
            async for item in stream:
                yield item
        except Exception as exc:
            await self._abort(context, method, request_id, exc)

    async def _abort(self, context: Any, method: str, request_id: str, exc: Exception) -> Any:
        code = status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("%s %s failed", method, request_id)
        else:
            log.info("%s %s -> %s: %s", method, request_id, code.name, exc)
        await context.abort(code, f"{type(exc).__name__}: {exc}")

    async def _wrong_role(self, context: Any, method: str, role: str) -> Any:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{method} is served by {role} workers; worker {self.config.worker_id} is a "
            f"{self.config.role} worker",
        )


def start_worker_metrics(config: WorkerServerConfig, roles: WorkerRoles) -> MetricsServer | None:
    """Serve the worker's ``/metrics`` from its stats (call on the worker's event loop)."""
    if config.metrics_port < 0:
        return None
    stats_fn = stats_fn_on_loop(lambda: roles.stats(config), asyncio.get_running_loop())
    metrics = start_metrics_server(config.metrics_port, stats_fn, config.host)
    log.info("worker %s metrics at %s", config.worker_id, metrics.url)
    return metrics


async def serve(
    config: WorkerServerConfig,
    engine_config: EngineConfig,
    transfer_config: TransferConfig,
    decode_config: DecodeConfig,
) -> None:
    """Run until SIGTERM/SIGINT."""
    servicer = WorkerServicer(config)
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_worker_service(server, servicer)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = add_worker_port(server, f"{config.host}:{config.port}", config.secret)
    await server.start()
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    log.info(
        "worker %s (%s) listening on %s:%d; loading",
        config.worker_id,
        config.role,
        config.host,
        port,
    )
    roles: WorkerRoles | None = None
    metrics: MetricsServer | None = None
    try:
        # SIGTERM while loading takes effect once the load is done (it cannot be interrupted)
        roles = await asyncio.to_thread(
            build_roles, config, engine_config, transfer_config, decode_config
        )
        await _start(roles)
        servicer.roles = roles
        metrics = start_worker_metrics(config, roles)
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
        _write_ready_file(config, port, metrics)
        log.info(
            "worker %s serving (epoch %d, pid %d)", config.worker_id, config.epoch, os.getpid()
        )
        await stop.wait()
        log.info("worker %s stopping (grace %.1fs)", config.worker_id, config.grace_s)
    finally:
        if metrics is not None:
            metrics.stop()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(config.grace_s)
        if roles is not None:
            await roles.close()
    log.info("worker %s stopped", config.worker_id)


async def _start(roles: WorkerRoles) -> None:
    """Start the engine thread and the role's background work, then warm up: one tiny
    request through the whole step path before reporting SERVING."""
    roles.engine.start()
    if roles.decode is not None:
        roles.decode.start()
    started_s = time.monotonic()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    async for _ in roles.engine.generate(f"warmup-{os.getpid()}", [1] * 8, params):
        pass
    log.info("warm-up done in %.2fs", time.monotonic() - started_s)


async def _set_health(servicer: Any, status: Any) -> None:
    for service in ("", SERVICE_NAME):
        await servicer.set(service, status)


def _write_ready_file(config: WorkerServerConfig, port: int, metrics: MetricsServer | None) -> None:
    if config.ready_file is None:
        return
    info = {
        "port": port,
        "address": f"{config.host}:{port}",
        "worker_id": config.worker_id,
        "epoch": config.epoch,
        "pid": os.getpid(),
        "role": config.role,
        "kv_backend": config.kv_backend,
        "metrics_port": metrics.port if metrics is not None else None,
    }
    path = Path(config.ready_file)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)  # atomic: a reader never sees half a file


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.worker.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--role", required=True, choices=ROLES)
    add("--host", default="127.0.0.1", help="address to bind and advertise")
    add("--port", type=int, default=0, help="gRPC port (0: pick a free one; see --ready-file)")
    add("--model", default="smollm2-135m-instruct", help="model name or path")
    add("--dtype", default="float32", choices=["float32", "bfloat16"])
    add("--kv-backend", default="nixl", choices=["nixl", "tcp"])
    add("--num-blocks", type=int, default=None, help="KV pool blocks (default: by memory)")
    add("--block-size", type=int, default=16)
    add_device_arguments(p)
    add_kv_cache_dtype_argument(p)
    add("--max-num-seqs", type=int, default=64)
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--no-prefix-caching", action="store_true")
    add("--transfer-timeout-s", type=float, default=30.0, help="bound of one KV transfer")
    add("--reservation-timeout-s", type=float, default=60.0, help="unclaimed KV reservations")
    add("--worker-id", default=None, help="default: ROLE-HOST-PID")
    add("--epoch", type=int, default=None, help="incarnation number (default: start time, s)")
    add("--ready-file", default=None, help="write JSON here once SERVING")
    add("--grace-s", type=float, default=5.0, help="in-flight calls' grace on SIGTERM")
    add("--torch-threads", type=int, default=None)
    add("--metrics-port", type=int, default=0, help="Prometheus /metrics (0: free port, -1: none)")
    add("--cluster-secret-file", type=Path, default=None,
        help="cluster secret file (mode 0600): mutual TLS on gRPC, authenticated KV")  # fmt: skip
    add("--fault-pause-after-blocks", type=int, default=None, help="test hook: sender pause")
    add("--fault-pause-s", type=float, default=0.0, help="test hook: length of that pause")
    add("--log-level", default="INFO")
    add_kv_tier_arguments(p)
    add_speculative_arguments(p)
    return p


def configs_from_args(
    args: argparse.Namespace, secret: ClusterSecret | None = None
) -> tuple[WorkerServerConfig, EngineConfig, TransferConfig, DecodeConfig]:
    """The configs the flags describe; ``secret`` (a host that holds it in memory) replaces
    ``--cluster-secret-file``."""
    if secret is None and args.cluster_secret_file is not None:
        secret = read_secret_file(args.cluster_secret_file)
    default_id = f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    worker_id = args.worker_id or re.sub(r"[^A-Za-z0-9._-]", "-", default_id)
    server = WorkerServerConfig(
        role=args.role,
        worker_id=worker_id[:128],
        epoch=args.epoch or int(time.time()),
        host=args.host,
        port=args.port,
        kv_backend=args.kv_backend,
        ready_file=args.ready_file,
        grace_s=args.grace_s,
        torch_threads=args.torch_threads,
        metrics_port=args.metrics_port,
        secret=secret,
    )
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        **device_settings(args),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=not args.no_prefix_caching,
            **kv_tier_settings(args),
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs
        ),
        speculation=role_speculation(args.role, args),
    )
    fault = None
    if args.fault_pause_after_blocks is not None:
        fault = FaultInjection(args.fault_pause_after_blocks, args.fault_pause_s)
    auth_key = secret.kv_transfer_key() if secret is not None else None
    transfer = TransferConfig(
        timeout_s=args.transfer_timeout_s, host=args.host, fault=fault, auth_key=auth_key
    )
    decode = DecodeConfig(args.reservation_timeout_s, args.transfer_timeout_s)
    return server, engine, transfer, decode


def role_speculation(role: str, args: argparse.Namespace) -> SpeculativeConfig:
    """The speculative decoding flags' config; ValueError when they ask a prefill worker
    to speculate (it samples only the first token: a speculator there is wasted memory)."""
    config = speculative_config(args)
    if role == "prefill" and config.enabled:
        raise ValueError(
            f"--speculative {config.method}: prefill workers never speculate (they sample only "
            "the first token); give it to decode and colocated workers"
        )
    return config


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configs = configs_from_args(args)
    except ValueError as err:
        print(f"pdserve.worker.server: error: {err}", file=sys.stderr)
        return 2
    server_config = configs[0]
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{server_config.worker_id}] %(name)s: %(message)s",
    )
    if server_config.torch_threads:
        import torch

        torch.set_num_threads(server_config.torch_threads)
    asyncio.run(serve(*configs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
