"""Peer fetch, the holding side: the FetchKV RPC another prefill worker calls to pull a
prompt prefix this worker holds (see ``peer_fetch.py`` for the whole exchange).

::

    FetchKV(prefix, destination) ──> hold the prefix's blocks (a reservation of the prefix:
                                     pool blocks kept, tier blocks loaded back into the pool)
                                 ──> every block held? else FAILED_PRECONDITION (evicted
                                     since the index said so: the fetcher computes them)
                                 ──> send our blocks [present:] -> destination[present:]
                                 ──> release the hold once the sender is done reading
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from pdserve.engine.async_engine import AsyncEngine
from pdserve.kv_transfer import KVSender
from pdserve.kv_transfer.handoff import KVDestination, PreconditionFailed
from pdserve.prefill_worker.peer_fetch import PeerFetchStats
from pdserve.prefill_worker.transfer import plan_transfer, send_planned
from pdserve.proto import worker_pb2
from pdserve.worker.checks import check_prompt, check_request_id
from pdserve.worker.convert import destination_from_proto

log = logging.getLogger(__name__)


class PeerHolder:
    """Serves FetchKV from this worker's cache through its KV sender."""

    def __init__(
        self,
        engine: AsyncEngine,
        sender: KVSender,
        worker_id: str,
        backend: str,
        wait_s: float,
        stats: PeerFetchStats,
    ) -> None:
        self.engine = engine
        self.sender = sender
        self.worker_id = worker_id
        self.backend = backend
        self.wait_s = wait_s  # the sender ends every transfer by then
        self.stats = stats
        self._block_size = engine.engine.config.cache.block_size
        self._serving: set[asyncio.Task[worker_pb2.TransferReport]] = set()

    async def fetch_kv(self, request: worker_pb2.FetchKVRequest) -> worker_pb2.TransferReport:
        """Check the request, then serve it to the end even if the caller goes away: the
        hold is released only once the sender has stopped reading the blocks."""
        request_id = check_request_id(request.request_id)
        prefix = check_prompt(request.prompt_token_ids)
        if len(prefix) % self._block_size:
            raise ValueError(
                f"FetchKV prompt_token_ids must be whole blocks of {self._block_size} tokens, "
                f"got {len(prefix)} tokens"
            )
        dest = destination_from_proto(request.destination)
        if dest.backend != self.backend:
            raise PreconditionFailed(
                f"fetcher {dest.worker_id!r} receives KV over {dest.backend!r} but worker "
                f"{self.worker_id} sends over {self.backend!r}; pair workers of one backend"
            )
        task = asyncio.ensure_future(self._serve(request_id, prefix, dest))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)
        return await asyncio.shield(task)

    async def close(self) -> None:
        if self._serving:
            await asyncio.wait(list(self._serving), timeout=self.wait_s + 5.0)

    async def _serve(
        self, request_id: str, prefix: list[int], dest: KVDestination
    ) -> worker_pb2.TransferReport:
        hold_id = f"peer-hold#{uuid.uuid4().hex}"
        reservation = await self.engine.reserve_import(hold_id, prefix, record_hits=False)
        try:
            num_blocks = len(prefix) // self._block_size
            held = reservation.num_local_blocks if reservation is not None else 0
            if reservation is None or held < num_blocks:
                raise PreconditionFailed(
                    f"worker {self.worker_id} holds {held} of the {num_blocks} blocks "
                    f"{dest.worker_id!r} asked for (evicted since the index said so, or no "
                    "room to load them back); compute them instead"
                )
            plan = plan_transfer(reservation.block_ids, dest)
            report, _ = await send_planned(self.sender, plan, self.wait_s)
        finally:
            await self.engine.cancel_import(hold_id)
        if report.ok:
            self.stats.served_blocks += report.blocks_sent
        log.info(
            "FetchKV %s from %s: %d blocks sent (%d present there), %d bytes in %.3fs%s",
            request_id,
            dest.worker_id,
            report.blocks_sent,
            report.blocks_skipped,
            report.bytes,
            report.seconds,
            f" FAILED ({report.error})" if not report.ok else "",
        )
        return report
