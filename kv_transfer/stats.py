"""Transfer counters: bytes, transfers ok/failed, seconds. One set per sender or receiver."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields, replace


@dataclass(slots=True, frozen=True)
class TransferStats:
    """A snapshot of one endpoint's counters since it started."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    transfer_seconds: float = 0.0  # summed over finished transfers
    bytes_saved_int8: int = 0  # versus sending the same blocks in the pool dtype
    transfers_in_flight: int = 0  # a gauge: open now (PENDING or TRANSFERRING)
    # Inputs that did not prove the cluster key, refused before any header was read: TCP
    # connections that failed the handshake, NIXL notices without a valid MAC.
    auth_refused: int = 0

    def plus(self, other: TransferStats) -> TransferStats:
        """Two endpoints' counters together (a worker with both a sender and a receiver)."""
        return TransferStats(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(self))
        )


class TransferCounters:
    """Thread-safe accumulators behind ``TransferStats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = TransferStats()

    def record_ok(self, *, sent: int = 0, received: int = 0, seconds: float, saved: int) -> None:
        with self._lock:
            s = self._stats
            self._stats = replace(
                s,
                bytes_sent=s.bytes_sent + sent,
                bytes_received=s.bytes_received + received,
                transfers_ok=s.transfers_ok + 1,
                transfer_seconds=s.transfer_seconds + seconds,
                bytes_saved_int8=s.bytes_saved_int8 + saved,
            )

    def record_failed(self, seconds: float) -> None:
        with self._lock:
            s = self._stats
            self._stats = replace(
                s,
                transfers_failed=s.transfers_failed + 1,
                transfer_seconds=s.transfer_seconds + seconds,
            )

    def record_refused(self) -> None:
        with self._lock:
            self._stats = replace(self._stats, auth_refused=self._stats.auth_refused + 1)

    def snapshot(self) -> TransferStats:
        with self._lock:
            return self._stats
