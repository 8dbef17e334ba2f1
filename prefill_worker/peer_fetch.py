"""Peer fetch, the fetching side: before a prefill, pull the prompt's leading blocks from the
prefill worker that holds them (the router names it in ``PrefillRequest.peer_prefix`` when
moving them beats computing them), then prefill only the rest.

::

    fetcher (this worker)                                  holder (another prefill worker)
      reserve the prefix: blocks cached here (pool or tier) are kept, the rest are fresh
      receiver.expect(fresh blocks)
      ── FetchKV(prefix, destination) ──────────────────────> hold the prefix's blocks
                                    <══ KV blocks (NIXL/TCP) ══ send the ones we lack
      <── TransferReport ───────────────────────────────────── release them
      our handle DONE -> cache the blocks under their hashes: the prefill finds them

The fetched blocks stay reserved until the prefill that uses them has taken them
(:meth:`PeerFetcher.release`), so nothing evicts them in between. Any failure (holder gone,
timeout, blocks evicted there meanwhile, no room here) is logged and counted, and the prefill
computes the prefix itself: a request is never lost to a fetch.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.kv_cache import ImportReservation
from pdserve.kv_transfer import KVReceiver, TransferHandle, TransferState
from pdserve.kv_transfer.handoff import KVDestination, await_handle
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker.convert import destination_to_proto

log = logging.getLogger(__name__)

# A channel to a peer's Worker service, by address (mutual TLS when the cluster has a secret:
# worker/mutual_tls.py, worker_channel_factory).
ConnectFn = Callable[[str], grpc.aio.Channel]


@dataclass(slots=True, frozen=True)
class PeerPrefix:
    """Where a prompt's leading ``num_blocks`` blocks are cached on another prefill worker."""

    worker_id: str
    address: str
    num_blocks: int


@dataclass(slots=True)
class PeerFetchStats:
    """Peer fetch counters since the worker started (GetStats and ``/metrics``)."""

    fetches: int = 0  # prefixes pulled from a peer
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    fallbacks: int = 0  # fetches that failed: the prefix was computed here instead
    served_blocks: int = 0  # blocks this worker sent to fetching peers

    def fill(self, msg: worker_pb2.WorkerStats) -> None:
        """Write the counters into a GetStats answer."""
        msg.peer_fetches = self.fetches
        msg.peer_fetched_blocks = self.fetched_blocks
        msg.peer_fetched_bytes = self.fetched_bytes
        msg.peer_served_blocks = self.served_blocks
        msg.recompute_fallbacks = self.fallbacks


class FetchFailed(Exception):
    """A peer fetch did not bring the blocks; the prefill computes them."""


class PeerFetcher:
    """Fetches prompt prefixes into this worker's pool through its KV receiver."""

    def __init__(
        self,
        engine: AsyncEngine,
        receiver: KVReceiver,
        worker_id: str,
        backend: str,
        timeout_s: float,
        stats: PeerFetchStats,
        connect: ConnectFn = grpc.aio.insecure_channel,
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self.worker_id = worker_id
        self.backend = backend
        self.timeout_s = timeout_s  # the receiver ends every transfer by then
        self.stats = stats
        self._block_size = engine.engine.config.cache.block_size
        self._connect = connect
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def fetch(self, request_id: str, prompt: list[int], peer: PeerPrefix) -> str | None:
        """Bring the prompt's first ``peer.num_blocks`` blocks here (those not here yet).

        Returns the id of the reservation holding them, to :meth:`release` once the
        prefill has taken them, or None when nothing is held (nothing to fetch, or the fetch
        failed: then the prefill computes the prefix).
        """
        # The last prompt token is always computed, so a block holding it is never reused.
        num_blocks = min(peer.num_blocks, (len(prompt) - 1) // self._block_size)
        if num_blocks <= 0:
            return None
        hold_id = f"{request_id}#fetch"
        prefix = prompt[: num_blocks * self._block_size]
        reservation = await self._reserve(hold_id, prefix)
        if reservation is None:
            self._fell_back(request_id, peer, "no free blocks here to receive it")
            return None
        if not reservation.blocks_to_receive:
            return hold_id  # every block is here already, in the pool or a tier
        started_s = time.monotonic()
        transfer_id = f"{request_id[:64]}#fetch-{uuid.uuid4().hex[:12]}"
        handle: TransferHandle | None = None
        try:
            handle = self.receiver.expect(transfer_id, reservation.blocks_to_receive)
            report = await self._pull(request_id, prefix, peer, reservation, handle)
            await self.engine.commit_import(hold_id)  # cached: the prefill's lookup finds them
        except (FetchFailed, grpc.aio.AioRpcError, ValueError) as err:
            self._fell_back(request_id, peer, _describe(err))
            self._spawn(self._discard(hold_id, handle))
            return None
        except asyncio.CancelledError:  # the caller went away: free the blocks, safely
            self._spawn(self._discard(hold_id, handle))
            raise
        self._count(request_id, peer, report, len(reservation.blocks_to_receive), started_s)
        return hold_id

    async def release(self, hold_id: str | None) -> None:
        """Give back the blocks a fetch reserved (they stay cached here)."""
        if hold_id is not None:
            await self.engine.cancel_import(hold_id)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.timeout_s + 5.0)
        for channel in self._channels.values():
            await channel.close()

    # -- internals ---------------------------------------------------------------------
    async def _reserve(self, hold_id: str, prefix: list[int]) -> ImportReservation | None:
        """Reserve on the engine; a caller that goes away meanwhile leaves nothing behind."""
        reserve = self.engine.reserve_import(hold_id, prefix, record_hits=False)
        task = asyncio.ensure_future(reserve)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda _: self._spawn(self.release(hold_id)))
            raise

    async def _pull(
        self,
        request_id: str,
        prefix: list[int],
        peer: PeerPrefix,
        reservation: ImportReservation,
        handle: TransferHandle,
    ) -> worker_pb2.TransferReport:
        destination = KVDestination(
            worker_id=self.worker_id,
            backend=self.backend,
            agent_metadata=self.receiver.connection_metadata(),
            block_ids=reservation.block_ids,
            num_present_blocks=reservation.num_local_blocks,
            transfer_id=handle.transfer_id,
        )
        request = worker_pb2.FetchKVRequest(
            request_id=request_id,
            prompt_token_ids=prefix,
            destination=destination_to_proto(destination),
        )
        report: worker_pb2.TransferReport = await self._stub(peer.address).FetchKV(
            request, timeout=self.timeout_s
        )
        if not report.ok:
            raise FetchFailed(f"the holder's transfer failed: {report.error}")
        state = await await_handle(handle, self.timeout_s)
        if state is not TransferState.DONE:
            raise FetchFailed(f"our receiving end is {state.name}: {handle.error}")
        return report

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._connect(address)
        return worker_pb2_grpc.WorkerStub(channel)

    async def _discard(self, hold_id: str, handle: TransferHandle | None) -> None:
        """Free the reserved blocks once no late write can land in them."""
        if handle is not None and not handle.finished:
            await await_handle(handle, self.timeout_s + 5.0)
        await self.engine.cancel_import(hold_id)

    def _fell_back(self, request_id: str, peer: PeerPrefix, why: str) -> None:
        self.stats.fallbacks += 1
        log.warning(
            "prefill %s: fetching %d blocks from %s (%s) failed, computing them instead: %s",
            request_id,
            peer.num_blocks,
            peer.worker_id,
            peer.address,
            why,
        )

    def _count(
        self,
        request_id: str,
        peer: PeerPrefix,
        report: worker_pb2.TransferReport,
        num_blocks: int,
        started_s: float,
    ) -> None:
        self.stats.fetches += 1
        self.stats.fetched_blocks += num_blocks
        self.stats.fetched_bytes += report.bytes
        log.info(
            "prefill %s: fetched %d blocks (%d bytes, %d already here) from %s in %.3fs",
            request_id,
            num_blocks,
            report.bytes,
            report.blocks_skipped,
            peer.worker_id,
            time.monotonic() - started_s,
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _describe(err: Exception) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"FetchKV -> {err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}"
