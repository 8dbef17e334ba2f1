"""Sending a prompt's KV to its decode worker: which blocks go where, and waiting on it.

A prompt of 5 blocks, of which the decode worker already caches the first 2::

    prompt block:          0     1     2     3     4
    our block table:     [17]  [ 4]  [30]  [ 9]  [12]
    destination ids:     [ 2]  [ 8]  [51]  [60]  [61]     num_present_blocks = 2
                          └ skipped ┘  30->51, 9->60, 12->61 are sent

Only whole blocks move; the last one may be partly filled (positions past the prompt are
never read by the receiver, which writes the first token's KV there next).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kv_transfer import TransferHandle, TransferState
from pdserve_proto import worker_pb2
from prefill_worker.convert import KVDestination
from prefill_worker.errors import RequestCancelled

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.002


@dataclass(slots=True, frozen=True)
class TransferPlan:
    """``dst_block_ids[i]`` (on the receiver) <- ``src_block_ids[i]`` (ours)."""

    transfer_id: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    blocks_skipped: int
    peer: bytes

    @property
    def empty(self) -> bool:
        return not self.src_block_ids


def plan_transfer(block_table: Sequence[int], dest: KVDestination) -> TransferPlan:
    """Pair our blocks with the destination's, skipping the ones it already holds.

    ValueError when the tables disagree on the prompt's length in blocks.
    """
    if len(block_table) != len(dest.block_ids):
        raise ValueError(
            f"transfer {dest.transfer_id!r}: the prompt fills {len(block_table)} blocks here "
            f"but the destination reserved {len(dest.block_ids)}; were both made from the "
            "same prompt and block size?"
        )
    start = dest.num_present_blocks
    return TransferPlan(
        transfer_id=dest.transfer_id,
        src_block_ids=tuple(block_table[start:]),
        dst_block_ids=dest.block_ids[start:],
        blocks_skipped=start,
        peer=dest.agent_metadata,
    )


async def await_handle(
    handle: TransferHandle, timeout_s: float, cancelled: asyncio.Event | None = None
) -> TransferState:
    """Wait (without blocking the event loop) until the transfer ends or ``timeout_s``
    passes; returns the state then. RequestCancelled once ``cancelled`` is set.

    Polls with a short sleep instead of parking a thread per transfer: thousands of
    waiting requests cost no threads, and the added latency stays under 2 ms.
    """
    deadline_s = time.monotonic() + timeout_s
    delay_s = _POLL_MIN_S
    while not handle.finished and time.monotonic() < deadline_s:
        if cancelled is not None and cancelled.is_set():
            raise RequestCancelled(f"cancelled while waiting for transfer {handle.transfer_id!r}")
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, _POLL_MAX_S)
    return handle.state


def report_for(
    plan: TransferPlan, handle: TransferHandle, wait_s: float
) -> worker_pb2.TransferReport:
    """The TransferReport of a finished (or abandoned, still running) transfer."""
    outcome = handle.outcome()
    ok = outcome.state is TransferState.DONE
    error = outcome.error or ""
    if not ok and not error:
        error = (
            f"transfer {plan.transfer_id!r} still {outcome.state.name} after {wait_s:.1f}s "
            f"({len(plan.src_block_ids)} blocks)"
        )
    return worker_pb2.TransferReport(
        ok=ok,
        error=error,
        bytes=outcome.bytes_moved,
        seconds=outcome.seconds,
        blocks_sent=len(plan.src_block_ids) if ok else 0,
        blocks_skipped=plan.blocks_skipped,
    )
