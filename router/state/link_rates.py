"""Measured KV transfer rates per (sender, receiver) worker pair (pure).

Routing predicts a request's KV transfer as bytes / link rate. One rate for every pair is
wrong as soon as the workers sit on different hosts: a decode worker behind a slow link
costs a long prompt seconds that a same-rack one does not. The prefill worker reports each
transfer it made (bytes, seconds) at the end of its Prefill stream; the router feeds those
reports here and routing reads the table back (``rates``).

* Only transfers of at least ``min_bytes`` count: a short one's time is mostly fixed
  costs (connecting, the handshake, the completion notice), so its bytes/seconds says
  little about the link. 4 MiB (six fp32 SmolLM2 blocks) takes ~34 ms at 1 Gbit/s; and
  links matter to routing only for prompts that move that much.
* Each pair keeps an exponentially weighted mean: a new report moves it by ``weight`` of
  the difference, so one odd transfer does not swing routing, and a link that changed
  (congestion, a new route) is followed within a few transfers.
* A pair not measured for ``max_age_s`` is dropped, and routing falls back to its default
  rate: a slow link once seen must not keep its pair out of use for ever, since nothing
  would be sent over it to learn that it recovered.

Routing reads the table on every request, far more often than transfers are reported, so a
read costs no walk over the pairs: the table keeps the snapshot it last handed out, and a
lower bound on when its oldest pair was measured; only once ``max_age_s`` has passed since
that bound does a read look for stale pairs (and raise the bound).

No clock of its own: callers pass ``now_s`` (``time.monotonic()``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

MIN_MEASURED_BYTES = 4 * 1024 * 1024

WorkerPair = tuple[str, str]  # (sender worker id, receiver worker id)


@dataclass(slots=True)
class _PairRate:
    bytes_per_s: float
    measured_s: float  # when the last counted transfer was reported


class LinkRates:
    """The recent KV transfer rate of each (sender, receiver) pair that moved enough bytes."""

    def __init__(
        self,
        weight: float = 0.3,
        min_bytes: int = MIN_MEASURED_BYTES,
        max_age_s: float = 300.0,
    ) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if min_bytes < 1 or max_age_s <= 0:
            raise ValueError(f"min_bytes and max_age_s must be > 0, got {min_bytes}, {max_age_s}")
        self.weight = weight
        self.min_bytes = min_bytes
        self.max_age_s = max_age_s
        self._pairs: dict[WorkerPair, _PairRate] = {}
        # No pair was last measured before this: none is stale while now_s - oldest_s <=
        # max_age_s.
        self._oldest_s = math.inf
        self._snapshot: Mapping[WorkerPair, float] | None = None  # None: rebuild on read

    def observe(
        self, sender: str, receiver: str, bytes_moved: int, seconds: float, now_s: float
    ) -> None:
        """A finished transfer of ``bytes_moved`` in ``seconds`` from sender to receiver."""
        if bytes_moved < self.min_bytes or seconds <= 0:
            return
        sample = bytes_moved / seconds
        self._snapshot = None
        self._oldest_s = min(self._oldest_s, now_s)
        pair = self._pairs.get((sender, receiver))
        if pair is None or now_s - pair.measured_s > self.max_age_s:
            self._pairs[(sender, receiver)] = _PairRate(sample, now_s)
            return
        pair.bytes_per_s += self.weight * (sample - pair.bytes_per_s)
        pair.measured_s = now_s

    def rates(self, now_s: float) -> Mapping[WorkerPair, float]:
        """Bytes/s of every pair measured within ``max_age_s``; older pairs are forgotten.
        A read-only view, the same object until the table changes."""
        if now_s - self._oldest_s > self.max_age_s:
            self._forget_stale(now_s)
        if self._snapshot is None:
            rates = {key: p.bytes_per_s for key, p in self._pairs.items()}
            self._snapshot = MappingProxyType(rates)
        return self._snapshot

    def _forget_stale(self, now_s: float) -> None:
        stale = [key for key, p in self._pairs.items() if now_s - p.measured_s > self.max_age_s]
        for key in stale:
            del self._pairs[key]
        if stale:
            self._snapshot = None
        self._oldest_s = min((p.measured_s for p in self._pairs.values()), default=math.inf)
