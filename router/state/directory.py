"""Where the workers are: the directory the router reads, and gRPC channels per address.

The Redis-backed registry in ``cluster/`` implements ``WorkerDirectory`` too; a worker whose
lease lapsed is simply absent from ``live_workers()``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.workers import WorkerInfo, WorkerLoad

if TYPE_CHECKING:  # the router needs only the type; cryptography loads where TLS is built
    from pdserve.worker.mutual_tls import ClientTls

log = logging.getLogger(__name__)


class WorkerDirectory(Protocol):
    def live_workers(self) -> Sequence[WorkerInfo]:
        """The workers that may be routed to now, with their latest known load."""
        ...


class StaticWorkerDirectory:
    """A fixed set of workers; loads are updated by ``poll_worker_stats`` or by hand."""

    def __init__(self, workers: Iterable[WorkerInfo]) -> None:
        self._workers: dict[str, WorkerInfo] = {}
        for worker in workers:
            if worker.worker_id in self._workers:
                raise ValueError(f"worker id {worker.worker_id!r} is listed twice")
            self._workers[worker.worker_id] = worker
        self._live: tuple[WorkerInfo, ...] = tuple(self._workers.values())

    def live_workers(self) -> Sequence[WorkerInfo]:
        return self._live

    def update_load(self, worker_id: str, load: WorkerLoad) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise ValueError(f"unknown worker id {worker_id!r}; known: {sorted(self._workers)}")
        self._workers[worker_id] = replace(worker, load=load)
        self._live = tuple(self._workers.values())


def load_from_stats(stats: worker_pb2.WorkerStats) -> WorkerLoad:
    return WorkerLoad(waiting=stats.waiting, running=stats.running, free_blocks=stats.free_blocks)


class ChannelPool:
    """One cached grpc.aio channel (and Worker stub) per worker address; mutual TLS with
    ``tls`` (the cluster secret's, worker/mutual_tls.py), plaintext without."""

    def __init__(
        self, tls: ClientTls | None = None, max_message_bytes: int = 16 * 1024 * 1024
    ) -> None:
        self._tls = tls
        self._options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # A worker whose host is cut off sends no reset: without pings a call to it
            # would wait for its deadline. Unanswered for 3 s, the call fails (UNAVAILABLE)
            # and the request retries or fails over.
            ("grpc.keepalive_time_ms", 2000),
            ("grpc.keepalive_timeout_ms", 3000),
            ("grpc.http2.max_pings_without_data", 0),
            # When the host is back (a new epoch, the same address), reconnect within 5 s.
            ("grpc.max_reconnect_backoff_ms", 5000),
        ]
        if tls is not None:
            self._options += tls.options
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._open(address)
            self._channels.append(channel)
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    def _open(self, address: str) -> grpc.aio.Channel:
        if self._tls is None:
            return grpc.aio.insecure_channel(address, options=self._options)
        return grpc.aio.secure_channel(address, self._tls.credentials, options=self._options)

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, [], {}
        await asyncio.gather(*(c.close() for c in channels))


async def poll_worker_stats(
    directory: StaticWorkerDirectory,
    channels: ChannelPool,
    interval_s: float = 0.5,
    timeout_s: float = 1.0,
) -> None:
    """Refresh every worker's load from its GetStats, forever (run it as a task)."""
    while True:
        for worker in directory.live_workers():
            try:
                stats = await channels.stub(worker.address).GetStats(
                    worker_pb2.StatsRequest(), timeout=timeout_s
                )
            except grpc.aio.AioRpcError as err:
                log.warning("GetStats on %s failed: %s", worker.worker_id, err.code())
                continue
            directory.update_load(worker.worker_id, load_from_stats(stats))
        await asyncio.sleep(interval_s)
