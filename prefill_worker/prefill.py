"""The Prefill RPC: compute the prompt, stream the first token at once, ship the KV. And
FetchKV, the same role's side of a peer fetch.

::

    Prefill(request)  ──> (peer_prefix: fetch the prompt's leading blocks from that prefill
                           worker first, peer_fetch.py; computed here if the fetch fails)
                      ──> engine.prefill: first token (KV held)  ──> event 1: first_token
                      ──> our block table[present:] -> destination[present:] (KV sender)
                      ──> release the KV (transfer ok or not)      ──> event 2: TransferReport
    FetchKV(prefix)   ──> peer_holder.py: send the prefix's blocks to the fetching worker

A transfer failure is a report with ``ok=false`` (the first token already went out); the
router then retries the transfer elsewhere or recomputes. The held KV is released only
once the sender is done reading it, even when the caller goes away mid-transfer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc

from pdserve.engine.async_engine import AsyncEngine
from pdserve.kv_transfer import (
    KVReceiver,
    KVSender,
    TransferConfig,
    TransferStats,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.handoff import KVDestination
from pdserve.prefill_worker.peer_fetch import ConnectFn, PeerFetcher, PeerFetchStats, PeerPrefix
from pdserve.prefill_worker.peer_holder import PeerHolder
from pdserve.prefill_worker.transfer import plan_transfer, send_planned
from pdserve.proto import worker_pb2
from pdserve.proto.params import params_from_proto
from pdserve.worker.checks import PromptLimits, check_prompt, check_request_id
from pdserve.worker.convert import destination_from_proto, step_to_chunk
from pdserve.worker.errors import PreconditionFailed, RequestCancelled

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Destinations remembered against replays; a reservation lives at most its timeout, far
# fewer transfers than this on one prefill worker.
_SENT_TO_REMEMBERED = 65536


class PrefillService:
    """Prefill-role handlers over one engine, a KV sender (to decode workers and fetching
    peers) and a KV receiver (for its own peer fetches)."""

    def __init__(
        self,
        engine: AsyncEngine,
        sender: KVSender,
        receiver: KVReceiver,
        worker_id: str,
        backend: str,
        transfer_timeout_s: float,
        connect: ConnectFn = grpc.aio.insecure_channel,
    ) -> None:
        self.engine = engine
        self.sender = sender
        self.receiver = receiver
        self.backend = backend
        # The sender ends every transfer within its own timeout; waiting a bit longer
        # only guards against a backend that breaks that promise.
        self._wait_s = transfer_timeout_s + 5.0
        self._block_size = engine.engine.config.cache.block_size
        self._limits = PromptLimits(
            engine.engine.model_config.vocab_size, engine.engine.max_model_len
        )
        # Destinations already sent to, oldest first: a replayed Prefill must not write into
        # blocks the decode worker may have given to another request since.
        self._sent_to: OrderedDict[str, None] = OrderedDict()
        self.peer_stats = PeerFetchStats()
        self.fetcher = PeerFetcher(
            engine, receiver, worker_id, backend, transfer_timeout_s, self.peer_stats, connect
        )
        self.holder = PeerHolder(engine, sender, worker_id, backend, self._wait_s, self.peer_stats)
        self._active: set[str] = set()  # first token out, KV not released yet
        # Hand-offs (send, then release the KV) after a first token went out: they run to
        # the end even when the Prefill caller goes away, since the decode worker waits;
        # and releases of fetched prefixes.
        self._background: set[asyncio.Task[Any]] = set()

    async def prefill(
        self, request: worker_pb2.PrefillRequest
    ) -> AsyncIterator[worker_pb2.PrefillEvent]:
        """The Prefill stream: first_token, then the TransferReport."""
        request_id = check_request_id(request.request_id)
        params = params_from_proto(request.params)
        prompt = check_prompt(request.prompt_token_ids)
        self._limits.check_token_ids(prompt, "prompt_token_ids")
        self._limits.check_context(len(prompt), params.max_tokens)
        dest = self._destination(request, len(prompt))
        peer = peer_prefix_from_proto(request)
        fetch_started_s = time.monotonic()
        hold_id = await self.fetcher.fetch(request_id, prompt, peer) if peer else None
        started_s = time.monotonic()
        try:
            first = await self.engine.prefill(request_id, prompt, params)
        finally:  # the prefill holds the fetched blocks now (or never will)
            self._spawn(self.fetcher.release(hold_id))
        if first.finish_reason == "abort":
            raise RequestCancelled(f"prefill {request_id!r} was cancelled before its first token")
        first_s = time.monotonic()
        ttft_s = first_s - started_s
        # The hand-off starts before the first token goes out: a caller may leave as soon as
        # it has that token, before this generator ever runs again, and the decode worker
        # still waits for the KV. The task, not this stream, releases the KV.
        self._active.add(request_id)
        self._remember_sent(dest.transfer_id)
        handoff = self._spawn(self._hand_off(request_id, dest, first.finished, first_s))
        handoff.add_done_callback(lambda task: _log_handoff(request_id, len(prompt), ttft_s, task))
        chunk = step_to_chunk(first)
        chunk.phase_times.prefill_s = ttft_s
        chunk.phase_times.fetch_s = started_s - fetch_started_s if peer else 0.0
        yield worker_pb2.PrefillEvent(first_token=chunk)
        report = await asyncio.shield(handoff)  # not stopped by the caller leaving
        yield worker_pb2.PrefillEvent(transfer=report)

    async def cancel(self, request_id: str) -> bool:
        """Cancel: a prefill mid-transfer finishes the transfer first (its stream's
        caller is told by the report); anything else is aborted and freed now."""
        if request_id in self._active:
            return True
        return await self.engine.abort(request_id)

    async def fetch_kv(self, request: worker_pb2.FetchKVRequest) -> worker_pb2.TransferReport:
        """FetchKV: another prefill worker pulls a prefix this worker holds."""
        return await self.holder.fetch_kv(request)

    @classmethod
    def create(
        cls,
        engine: AsyncEngine,
        worker_id: str,
        backend: str,
        config: TransferConfig,
        connect: ConnectFn = grpc.aio.insecure_channel,
    ) -> PrefillService:
        """A service with its own sender and receiver over the engine's KV pool (blocking:
        NIXL setup); ``connect`` opens channels to the peers it fetches from."""
        pool = engine.engine.runner.kv_cache
        sender = make_sender(backend, config)
        sender.register_pool(pool)
        receiver = make_receiver(backend, config)
        receiver.register_pool(pool)
        return cls(engine, sender, receiver, worker_id, backend, config.timeout_s, connect)

    def transfer_stats(self) -> TransferStats:
        """Both ends: KV sent (to decode workers, to fetching peers) and fetched."""
        return self.sender.stats().plus(self.receiver.stats())

    async def close(self) -> None:
        """Let transfers in flight end and their KV be released, then close both ends."""
        await self.holder.close()
        await self.fetcher.close()
        if self._background:
            await asyncio.wait(list(self._background), timeout=self._wait_s)
        self.sender.close()
        self.receiver.close()

    def _destination(self, request: worker_pb2.PrefillRequest, prompt_tokens: int) -> KVDestination:
        """The checked destination: everything a send would refuse is refused here, before
        the prompt is computed."""
        if not request.HasField("destination"):
            raise ValueError(
                "Prefill needs a destination: the decode worker's ReserveKV answer "
                "(use Generate to serve a request on one worker)"
            )
        dest = destination_from_proto(request.destination)
        if dest.backend != self.backend:
            raise PreconditionFailed(
                f"destination {dest.worker_id!r} receives KV over {dest.backend!r} but this "
                f"prefill worker sends over {self.backend!r}; pair workers of one backend"
            )
        blocks = -(-prompt_tokens // self._block_size)
        if len(dest.block_ids) != blocks:
            raise ValueError(
                f"destination.block_ids holds {len(dest.block_ids)} ids but the prompt's "
                f"{prompt_tokens} tokens fill {blocks} blocks of {self._block_size}; pass the "
                "ReserveKV answer for this prompt"
            )
        if dest.transfer_id in self._sent_to:
            raise PreconditionFailed(
                f"destination.transfer_id {dest.transfer_id!r} was sent to already; a "
                "reservation takes one transfer (reserve again for a new attempt)"
            )
        to_send = dest.block_ids[dest.num_present_blocks :]
        if to_send:
            try:
                self.sender.check_destination(dest.transfer_id, dest.agent_metadata, to_send)
            except ValueError as exc:
                raise ValueError(
                    f"destination {dest.worker_id!r} cannot be sent to: {exc}"
                ) from exc
        return dest

    def _remember_sent(self, transfer_id: str) -> None:
        self._sent_to[transfer_id] = None
        if len(self._sent_to) > _SENT_TO_REMEMBERED:
            self._sent_to.popitem(last=False)

    async def _send(
        self, request_id: str, dest: KVDestination, first_s: float
    ) -> worker_pb2.TransferReport:
        try:
            plan = plan_transfer(await self.engine.block_table(request_id), dest)
        except ValueError as exc:  # tables disagree, or a Cancel freed the KV already
            return worker_pb2.TransferReport(ok=False, error=str(exc))
        report, handle = await send_planned(self.sender, plan, self._wait_s)
        if handle is not None:
            report.since_first_token_s = (handle.ended_at_s or time.monotonic()) - first_s
        return report

    async def _hand_off(
        self, request_id: str, dest: KVDestination, finished: bool, first_s: float
    ) -> worker_pb2.TransferReport:
        """Send the KV (unless the first token ended the request), then release it: only
        once the sender has stopped reading the blocks, whether or not the caller stayed."""
        try:
            if finished:  # nothing left to decode: the KV is not needed elsewhere
                return worker_pb2.TransferReport(ok=True)
            return await self._send(request_id, dest, first_s)
        finally:
            try:
                await self.engine.release(request_id)
            finally:
                self._active.discard(request_id)

    def _spawn(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task


def _log_handoff(
    request_id: str,
    prompt_tokens: int,
    ttft_s: float,
    handoff: asyncio.Task[worker_pb2.TransferReport],
) -> None:
    if handoff.cancelled() or handoff.exception() is not None:
        log.error("prefill %s: KV hand-off failed", request_id, exc_info=handoff.exception())
        return
    report = handoff.result()
    log.info(
        "prefill %s: %d prompt tokens, first token after %.3fs; KV %s: %d blocks sent, "
        "%d skipped, %d bytes in %.3fs%s",
        request_id,
        prompt_tokens,
        ttft_s,
        "ok" if report.ok else "FAILED",
        report.blocks_sent,
        report.blocks_skipped,
        report.bytes,
        report.seconds,
        f" ({report.error})" if report.error else "",
    )


def peer_prefix_from_proto(request: worker_pb2.PrefillRequest) -> PeerPrefix | None:
    """The request's peer prefix; None when unset. ValueError when it is half filled."""
    if not request.HasField("peer_prefix"):
        return None
    msg = request.peer_prefix
    if not msg.worker_id or not msg.address or msg.num_blocks < 1:
        raise ValueError(
            "peer_prefix needs worker_id, address and num_blocks >= 1 (the holder the "
            f"router chose), got {msg.worker_id!r}, {msg.address!r}, {msg.num_blocks}"
        )
    return PeerPrefix(msg.worker_id, msg.address, msg.num_blocks)
