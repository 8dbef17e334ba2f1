"""The decode role: reserve blocks for a prompt's KV, then decode once it has landed.

::

    ReserveKV ──> engine.reserve_import ──> None: accepted=false (back-pressure)
                                        └─> receiver.expect(blocks to receive) -> destination
    Decode    ──> claim the reservation ──> wait for the transfer (transfer_timeout_s)
              ──> engine.decode_imported (admit, continue after the first token) ──> chunks

A reservation no Decode claims within ``reservation_timeout_s`` is freed. Blocks are given
back only after the transfer into them has ended, so no late write lands in reused blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from pdserve.decode_worker.config import DecodeConfig
from pdserve.decode_worker.reservations import Reservation, ReservationTable
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.kv_cache import ImportReservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import (
    KVReceiver,
    TransferConfig,
    TransferState,
    TransferStats,
    make_receiver,
)
from pdserve.kv_transfer.handoff import (
    KVDestination,
    PreconditionFailed,
    TransferFailed,
    TransferTimedOut,
    await_handle,
)
from pdserve.proto import common_pb2, worker_pb2
from pdserve.proto.params import params_from_proto
from pdserve.worker.checks import PromptLimits, check_prompt, check_request_id
from pdserve.worker.convert import destination_to_proto, first_token_from_proto, step_to_chunk

log = logging.getLogger(__name__)


class DecodeService:
    """Decode-role handlers over one engine and one KV receiver."""

    def __init__(
        self,
        engine: AsyncEngine,
        receiver: KVReceiver,
        worker_id: str,
        backend: str,
        config: DecodeConfig,
        receiver_timeout_s: float,
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self.worker_id = worker_id
        self.backend = backend
        self.config = config
        self.table = ReservationTable()
        self._limits = PromptLimits(
            engine.engine.model_config.vocab_size, engine.engine.max_model_len
        )
        self._drain_s = receiver_timeout_s + 5.0  # the receiver ends every transfer by then
        self._background: set[asyncio.Task[Any]] = set()
        self._reaper: asyncio.Task[None] | None = None

    @classmethod
    def create(
        cls,
        engine: AsyncEngine,
        worker_id: str,
        backend: str,
        transfer_config: TransferConfig,
        config: DecodeConfig,
    ) -> DecodeService:
        """A service with its own receiver over the engine's KV pool (blocking: NIXL setup)."""
        receiver = make_receiver(backend, transfer_config)
        receiver.register_pool(engine.engine.runner.kv_cache)
        return cls(engine, receiver, worker_id, backend, config, transfer_config.timeout_s)

    def transfer_stats(self) -> TransferStats:
        return self.receiver.stats()

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for reservation in self.table.take_expired(float("inf")):
            self._spawn(self._discard(reservation, "worker stopping"))
        if self._background:
            await asyncio.wait(list(self._background), timeout=self._drain_s)
        self.receiver.close()

    # -- ReserveKV ---------------------------------------------------------------------
    async def reserve_kv(
        self, request: worker_pb2.ReserveKVRequest
    ) -> worker_pb2.ReserveKVResponse:
        request_id = check_request_id(request.request_id)
        prompt = check_prompt(request.prompt_token_ids)
        self._limits.check_token_ids(prompt, "prompt_token_ids")
        self._limits.check_context(len(prompt))
        self._check_pool_fits(prompt)
        if request_id in self.table:
            raise ValueError(f"request {request_id!r} already holds a KV reservation here")
        blocks = await self._reserve_blocks(request_id, prompt)
        if blocks is None:
            log.info("reserve %s: refused, not enough free blocks (back-pressure)", request_id)
            return worker_pb2.ReserveKVResponse(accepted=False)
        try:
            reservation = self._expect(request_id, prompt, blocks)
        except Exception:  # the receiver refused: give the blocks back, then report it
            self._spawn(self.engine.cancel_import(request_id))
            raise
        self.table.add(reservation)
        log.info(
            "reserve %s: %d blocks (%d present here), transfer %s",
            request_id,
            len(blocks.block_ids),
            blocks.num_local_blocks,
            reservation.transfer_id,
        )
        return worker_pb2.ReserveKVResponse(
            accepted=True, destination=destination_to_proto(self._destination(reservation))
        )

    async def _reserve_blocks(self, request_id: str, prompt: list[int]) -> ImportReservation | None:
        """Reserve on the engine; a caller that goes away meanwhile leaves nothing behind."""
        task = asyncio.ensure_future(self.engine.reserve_import(request_id, prompt))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._undo_reserve(request_id, t))
            raise

    def _undo_reserve(self, request_id: str, task: asyncio.Task[ImportReservation | None]) -> None:
        if not task.cancelled() and task.exception() is None and task.result() is not None:
            self._spawn(self.engine.cancel_import(request_id))

    def _expect(self, request_id: str, prompt: list[int], blocks: ImportReservation) -> Reservation:
        transfer_id = f"{request_id[:64]}#{uuid.uuid4().hex[:12]}"
        to_receive = blocks.blocks_to_receive
        handle = self.receiver.expect(transfer_id, to_receive) if to_receive else None
        return Reservation(
            request_id=request_id,
            transfer_id=transfer_id,
            prompt_token_ids=tuple(prompt),
            block_ids=blocks.block_ids,
            num_present_blocks=blocks.num_local_blocks,
            handle=handle,
            expires_at_s=time.monotonic() + self.config.reservation_timeout_s,
        )

    def _destination(self, reservation: Reservation) -> KVDestination:
        return KVDestination(
            worker_id=self.worker_id,
            backend=self.backend,
            agent_metadata=self.receiver.connection_metadata(),
            block_ids=reservation.block_ids,
            num_present_blocks=reservation.num_present_blocks,
            transfer_id=reservation.transfer_id,
        )

    # -- Decode ------------------------------------------------------------------------
    async def decode(
        self, request: worker_pb2.DecodeRequest
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        """Wait for the KV, then stream the tokens after the first one."""
        request_id = check_request_id(request.request_id)
        params, first_token, timeout_s = self._decode_inputs(request)  # before claiming it
        reservation = self.table.claim(request_id)
        if reservation is None:
            raise PreconditionFailed(
                f"worker {self.worker_id} holds no unclaimed KV reservation for request "
                f"{request_id!r}: it was never made here (ReserveKV), already claimed, "
                f"cancelled, or expired after {self.config.reservation_timeout_s:.0f}s"
            )
        opened = False
        try:
            _check_same_prompt(request, reservation)
            called_s = time.monotonic()
            waited_s = await self._await_transfer(reservation, timeout_s)
            prompt = list(reservation.prompt_token_ids)
            num_tokens, started_s = 0, time.monotonic()
            stream = self.engine.decode_imported(request_id, prompt, params, first_token)
            async for out in stream:
                opened = True
                chunk = step_to_chunk(out)
                if num_tokens == 0:
                    _stamp_phase_times(chunk, called_s, reservation)
                num_tokens += len(out.token_ids)
                yield chunk
            opened = True
            log.info(
                "decode %s: waited %.3fs for KV, %d tokens in %.3fs",
                request_id,
                waited_s,
                num_tokens,
                time.monotonic() - started_s,
            )
        finally:
            if self.table.get(request_id) is reservation:
                self.table.pop(request_id)
            if not opened:  # the engine never took the blocks over: give them back here
                self._spawn(self._discard(reservation, "Decode did not start"))

    def _decode_inputs(
        self, request: worker_pb2.DecodeRequest
    ) -> tuple[SamplingParams, int, float]:
        """Params, first token and transfer timeout; ValueError naming a bad one."""
        params = params_from_proto(request.params)
        if params.n != 1:
            raise ValueError(f"disaggregated serving takes n == 1, got n={params.n}")
        if not request.HasField("first_token"):
            raise ValueError("Decode needs first_token: the prefill worker's first event")
        first_token = first_token_from_proto(request.first_token)
        self._limits.check_token_ids([first_token], "first_token")
        self._limits.check_context(len(request.prompt_token_ids), params.max_tokens)
        if not 0.0 <= request.transfer_timeout_s < float("inf"):  # also refuses NaN
            raise ValueError(
                "transfer_timeout_s must be a finite number of seconds >= 0 (0: this "
                f"worker's default), got {request.transfer_timeout_s}"
            )
        timeout_s = request.transfer_timeout_s or self.config.default_transfer_timeout_s
        return params, first_token, timeout_s

    async def _await_transfer(self, reservation: Reservation, timeout_s: float) -> float:
        """Seconds waited; TransferFailed / TransferTimedOut / RequestCancelled otherwise."""
        handle = reservation.handle
        if handle is None:
            return 0.0
        started_s = time.monotonic()
        state = await await_handle(handle, timeout_s, reservation.cancelled)
        if state is TransferState.DONE:
            return time.monotonic() - started_s
        where = (
            f"KV transfer {reservation.transfer_id!r} of request {reservation.request_id!r} "
            f"({reservation.num_blocks_to_receive} blocks) to worker {self.worker_id}"
        )
        if state is TransferState.FAILED:
            raise TransferFailed(f"{where} failed: {handle.error}")
        raise TransferTimedOut(
            f"{where} did not complete within {timeout_s:.1f}s (state {state.name}); "
            "its blocks are freed: prefill again or recompute"
        )

    # -- Cancel and cleanup --------------------------------------------------------------
    async def cancel(self, request_id: str) -> bool:
        """Free what this worker holds for the request; True if it held anything."""
        reservation = self.table.get(request_id)
        if reservation is not None and not reservation.claimed:
            self.table.pop(request_id)
            self._spawn(self._discard(reservation, "cancelled"))
            return True
        if reservation is not None:
            reservation.cancelled.set()  # a Decode waiting for its KV gives up
        return await self.engine.abort(request_id) or reservation is not None

    async def _discard(self, reservation: Reservation, reason: str) -> None:
        handle = reservation.handle
        if handle is not None and not handle.finished:
            await await_handle(handle, self._drain_s)
        await self.engine.cancel_import(reservation.request_id)
        log.info(
            "reservation %s (transfer %s, %d blocks) freed: %s",
            reservation.request_id,
            reservation.transfer_id,
            len(reservation.block_ids),
            reason,
        )

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            for reservation in self.table.take_expired(time.monotonic()):
                reason = f"unclaimed after {self.config.reservation_timeout_s:.1f}s"
                self._spawn(self._discard(reservation, reason))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _check_pool_fits(self, prompt: list[int]) -> None:
        """A prompt this worker could never hold is bad input, not back-pressure."""
        kv = self.engine.engine.kv
        blocks = kv.num_blocks_for_tokens(len(prompt))
        if blocks > kv.num_blocks:
            raise ValueError(
                f"prompt_token_ids: {len(prompt)} tokens need {blocks} KV blocks; this "
                f"worker's pool holds {kv.num_blocks}"
            )


def _check_same_prompt(request: worker_pb2.DecodeRequest, reservation: Reservation) -> None:
    if tuple(request.prompt_token_ids) != reservation.prompt_token_ids:
        raise ValueError(
            f"Decode prompt ({len(request.prompt_token_ids)} tokens) differs from the one "
            f"reserved for {reservation.request_id!r} ({len(reservation.prompt_token_ids)} "
            "tokens); send the same prompt to ReserveKV, Prefill and Decode"
        )


def _stamp_phase_times(
    chunk: common_pb2.TokenChunk, called_s: float, reservation: Reservation
) -> None:
    """The decode side of a TTFT breakdown, on the first chunk: the wait for the KV, then the
    first step (admission included) from when both the Decode call and the KV were in."""
    handle = reservation.handle
    landed_s = handle.ended_at_s if handle is not None else None
    ready_s = max(called_s, landed_s or called_s)
    chunk.phase_times.kv_wait_s = ready_s - called_s
    chunk.phase_times.first_step_s = time.monotonic() - ready_s
