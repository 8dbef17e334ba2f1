"""Reservations: blocks set aside for a prompt whose KV another worker sends.

Lifecycle of one (all on the event loop thread)::

    ReserveKV ──add──> unclaimed ──claim (Decode)──> claimed ──pop──> gone (engine owns KV)
                          │
                          ├─ Cancel ─────────> gone: blocks freed once the transfer ended
                          └─ expires_at_s ───> gone: blocks freed once the transfer ended
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.kv_transfer import TransferHandle


@dataclass(slots=True, eq=False)
class Reservation:
    request_id: str
    transfer_id: str
    prompt_token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    num_present_blocks: int
    handle: TransferHandle | None  # None: every block is present, nothing to receive
    expires_at_s: float  # time.monotonic() after which an unclaimed one is freed
    claimed: bool = False
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_blocks_to_receive(self) -> int:
        return len(self.block_ids) - self.num_present_blocks


class ReservationTable:
    """request id -> Reservation. Not thread-safe: used from the event loop only."""

    def __init__(self) -> None:
        self._by_id: dict[str, Reservation] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def add(self, reservation: Reservation) -> None:
        if reservation.request_id in self._by_id:
            raise ValueError(
                f"request {reservation.request_id!r} already holds a KV reservation here; "
                "use a new request id per attempt"
            )
        self._by_id[reservation.request_id] = reservation

    def get(self, request_id: str) -> Reservation | None:
        return self._by_id.get(request_id)

    def claim(self, request_id: str) -> Reservation | None:
        """The unclaimed reservation for ``request_id``, now claimed; None if there is none."""
        reservation = self._by_id.get(request_id)
        if reservation is None or reservation.claimed:
            return None
        reservation.claimed = True
        return reservation

    def pop(self, request_id: str) -> Reservation | None:
        return self._by_id.pop(request_id, None)

    def take_expired(self, now_s: float) -> list[Reservation]:
        """Remove and return the unclaimed reservations whose time is up."""
        expired = [r for r in self._by_id.values() if not r.claimed and r.expires_at_s <= now_s]
        for reservation in expired:
            del self._by_id[reservation.request_id]
        return expired
