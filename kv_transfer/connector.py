"""The KV connector interface, split by role, and the transfer handle both roles return.

A transfer moves blocks ``src_block_ids`` of the sender's pool into blocks ``dst_block_ids``
of the receiver's pool. The receiver allocates the destination blocks, calls ``expect`` and
hands its ``connection_metadata()`` (opaque bytes) to the sender out of band (the workers'
gRPC API); the sender calls ``send``. Each side gets a ``TransferHandle``::

    PENDING ──> TRANSFERRING ──> DONE
       │              │
       └──────────────┴──────> FAILED   (error, timeout, dead peer, bad header)

Every transfer ends DONE or FAILED within ``TransferConfig.timeout_s`` of its start, and
then both sides forget it. On FAILED the receiver's destination blocks hold garbage: the
caller frees them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

import torch

from pdserve.kv_transfer.stats import TransferStats


class TransferState(Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


_NEXT_STATES: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset({TransferState.TRANSFERRING, TransferState.FAILED}),
    TransferState.TRANSFERRING: frozenset({TransferState.DONE, TransferState.FAILED}),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
}


@dataclass(slots=True, frozen=True)
class TransferOutcome:
    """A picklable snapshot of a handle."""

    transfer_id: str
    state: TransferState
    history: tuple[TransferState, ...]
    error: str | None
    bytes_moved: int
    seconds: float


class TransferHandle:
    """One side's view of one transfer. Thread-safe; backends drive it, callers wait on it."""

    __slots__ = ("_bytes", "_cond", "_end_s", "_error", "_history", "_start_s", "transfer_id")

    def __init__(self, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        self._cond = threading.Condition()
        self._history: list[TransferState] = [TransferState.PENDING]
        self._error: str | None = None
        self._bytes = 0
        self._start_s = time.monotonic()
        self._end_s: float | None = None

    @property
    def state(self) -> TransferState:
        with self._cond:
            return self._history[-1]

    @property
    def finished(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def bytes_moved(self) -> int:
        """Bytes that crossed the wire (records, not headers) once DONE; 0 before."""
        return self._bytes

    @property
    def seconds(self) -> float:
        """Time from the handle's creation to its end (or to now while unfinished)."""
        end = self._end_s if self._end_s is not None else time.monotonic()
        return end - self._start_s

    @property
    def ended_at_s(self) -> float | None:
        """``time.monotonic()`` when the handle ended (DONE or FAILED); None while open."""
        return self._end_s

    def wait(self, timeout_s: float | None = None) -> TransferState:
        """Block until DONE or FAILED or ``timeout_s`` passes; return the state then."""
        with self._cond:
            self._cond.wait_for(lambda: self._end_s is not None, timeout=timeout_s)
            return self._history[-1]

    def outcome(self) -> TransferOutcome:
        with self._cond:
            history = tuple(self._history)
        return TransferOutcome(
            self.transfer_id, history[-1], history, self._error, self._bytes, self.seconds
        )

    # Backend side -----------------------------------------------------------------------

    def start(self) -> bool:
        """PENDING -> TRANSFERRING; False (no change) if the handle already ended."""
        with self._cond:
            if self._history[-1] is not TransferState.PENDING:
                return False
            self._history.append(TransferState.TRANSFERRING)
            return True

    def succeed(self, bytes_moved: int) -> bool:
        """TRANSFERRING -> DONE; False if the handle already ended (e.g. timed out)."""
        with self._cond:
            if self._end_s is not None:
                return False
            self._bytes = bytes_moved
            self._move_to(TransferState.DONE)
            return True

    def fail(self, error: str) -> bool:
        """-> FAILED with ``error``; False if the handle already ended."""
        with self._cond:
            if self._end_s is not None:
                return False
            self._move_to(TransferState.FAILED)
            self._error = error
            return True

    def _move_to(self, state: TransferState) -> None:
        current = self._history[-1]
        assert state in _NEXT_STATES[current], (
            f"transfer {self.transfer_id!r}: illegal transition {current.name} -> {state.name}"
        )
        self._history.append(state)
        self._end_s = time.monotonic()
        self._cond.notify_all()

    def __repr__(self) -> str:
        return f"TransferHandle({self.transfer_id!r}, {self.state.name}, error={self._error!r})"


@runtime_checkable
class KVSender(Protocol):
    """The sending side (prefill worker): pushes blocks of its pool to a receiver."""

    def register_pool(self, pool: torch.Tensor) -> None:
        """Register the worker's whole KV pool once, before any ``send``."""
        ...

    def send(
        self,
        transfer_id: str,
        src_block_ids: Sequence[int],
        peer: bytes,
        dst_block_ids: Sequence[int],
    ) -> TransferHandle:
        """Start moving ``src_block_ids`` into the peer's ``dst_block_ids`` (same order).

        ``peer`` is the receiver's ``connection_metadata()``. Returns at once; the caller
        keeps the source blocks unchanged until the handle ends. ValueError on bad ids or a
        peer whose pool format differs from ours.
        """
        ...

    def check_destination(
        self, transfer_id: str, peer: bytes, dst_block_ids: Sequence[int]
    ) -> None:
        """ValueError naming the problem when ``send`` would refuse this destination
        (metadata malformed or of another backend, pool format, ids, transfer id); no
        connection is made."""
        ...

    def stats(self) -> TransferStats: ...

    def close(self) -> None: ...


@runtime_checkable
class KVReceiver(Protocol):
    """The receiving side (decode worker): accepts blocks into its pool."""

    def register_pool(self, pool: torch.Tensor) -> None:
        """Register the worker's whole KV pool once, before ``connection_metadata``."""
        ...

    def connection_metadata(self) -> bytes:
        """Opaque bytes a sender needs to reach this receiver (exchanged over gRPC)."""
        ...

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int]) -> TransferHandle:
        """Announce that ``transfer_id`` will fill ``dst_block_ids`` (allocated by the caller).

        The handle fails if no complete, valid transfer arrives within the timeout.
        """
        ...

    def stats(self) -> TransferStats: ...

    def close(self) -> None: ...
