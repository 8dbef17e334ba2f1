"""Decode-role settings (one frozen dataclass; worker/server.py builds it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class DecodeConfig:
    """``reservation_timeout_s``: a reservation no Decode call claims by then is freed (the
    router died, or chose another worker). It must cover the prefill's queueing and compute.
    ``default_transfer_timeout_s``: how long Decode waits for the KV when the request does
    not say (``transfer_timeout_s == 0``)."""

    reservation_timeout_s: float = 60.0
    default_transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.reservation_timeout_s <= 0 or self.default_transfer_timeout_s <= 0:
            raise ValueError(
                "reservation_timeout_s and default_transfer_timeout_s must be > 0, got "
                f"{self.reservation_timeout_s}, {self.default_transfer_timeout_s}"
            )

    @property
    def reap_interval_s(self) -> float:
        return min(1.0, self.reservation_timeout_s / 4)
