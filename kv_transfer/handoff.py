"""The KV handoff between a prefill and a decode worker: where the KV goes, waiting for it,
and how it fails. Shared by both worker roles (neither imports the other).

::

    decode: ReserveKV -> KVDestination ──(router)──> prefill: send into it
    both:   await_handle(transfer handle) -> DONE | FAILED | still running at the timeout

The errors are what the caller can act on; ``pdserve.worker.errors.status_for`` maps them to
gRPC codes in one place. Bad caller input stays a plain ``ValueError``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdserve.kv_transfer.connector import TransferHandle, TransferState

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.002


@dataclass(slots=True, frozen=True)
class KVDestination:
    """Where a prefill sends a prompt's KV: the decode worker's reservation.

    ``block_ids[i]`` receives prompt block ``i``; the first ``num_present_blocks`` are
    already there (its prefix cache), so they are not sent.
    """

    worker_id: str
    backend: str
    agent_metadata: bytes
    block_ids: tuple[int, ...]
    num_present_blocks: int
    transfer_id: str


class HandoffError(Exception):
    """Base of the workers' own failures around a handoff (not bad input)."""


class PreconditionFailed(HandoffError):
    """The call does not fit this worker's state or role (FAILED_PRECONDITION): e.g. a
    Decode without a live reservation, or a Prefill for another KV backend."""


class RequestCancelled(HandoffError):
    """The request was cancelled (a Cancel RPC) while the call was waiting (CANCELLED)."""


class TransferFailed(HandoffError):
    """The KV transfer ended FAILED (ABORTED): the prompt must be sent again or recomputed."""


class TransferTimedOut(HandoffError):
    """The KV transfer did not finish in the time the caller allowed (UNAVAILABLE)."""


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
