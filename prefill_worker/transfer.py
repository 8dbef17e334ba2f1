"""Sending a prompt's KV to its decode worker: which blocks go where, and its report.

(Waiting on a transfer, ``await_handle``, is shared with the decode role:
pdserve.kv_transfer.handoff.)

A prompt of 5 blocks, of which the decode worker already caches the first 2::

    prompt block:          0     1     2     3     4
    our block table:     [17]  [ 4]  [30]  [ 9]  [12]
    destination ids:     [ 2]  [ 8]  [51]  [60]  [61]     num_present_blocks = 2
                          └ skipped ┘  30->51, 9->60, 12->61 are sent

Only whole blocks move; the last one may be partly filled (positions past the prompt are
never read by the receiver, which writes the first token's KV there next).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kv_transfer import KVSender, TransferHandle, TransferState
from pdserve.kv_transfer.handoff import KVDestination, await_handle
from pdserve.proto import worker_pb2

__all__ = ["TransferPlan", "await_handle", "plan_transfer", "report_for", "send_planned"]


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


async def send_planned(
    sender: KVSender, plan: TransferPlan, wait_s: float
) -> tuple[worker_pb2.TransferReport, TransferHandle | None]:
    """Send ``plan`` and wait (at most ``wait_s``) for its end: its report, and its handle
    (None when nothing was sent: an empty plan, or a send that could not start)."""
    if plan.empty:
        return worker_pb2.TransferReport(ok=True, blocks_skipped=plan.blocks_skipped), None
    try:
        handle = sender.send(plan.transfer_id, plan.src_block_ids, plan.peer, plan.dst_block_ids)
    except Exception as exc:  # bad peer metadata, unreachable peer: this transfer only
        error = f"transfer {plan.transfer_id!r}: {type(exc).__name__}: {exc}"
        return worker_pb2.TransferReport(
            ok=False, error=error, blocks_skipped=plan.blocks_skipped
        ), None
    await await_handle(handle, wait_s)
    return report_for(plan, handle, wait_s), handle
