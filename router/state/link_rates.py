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

No clock of its own: callers pass ``now_s`` (``time.monotonic()``).
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def observe(
        self, sender: str, receiver: str, bytes_moved: int, seconds: float, now_s: float
    ) -> None:
        """A finished transfer of ``bytes_moved`` in ``seconds`` from sender to receiver."""
        if bytes_moved < self.min_bytes or seconds <= 0:
            return
        sample = bytes_moved / seconds
        pair = self._pairs.get((sender, receiver))
        if pair is None or now_s - pair.measured_s > self.max_age_s:
            self._pairs[(sender, receiver)] = _PairRate(sample, now_s)
            return
        pair.bytes_per_s += self.weight * (sample - pair.bytes_per_s)
        pair.measured_s = now_s

    def rates(self, now_s: float) -> dict[WorkerPair, float]:
        """Bytes/s of every pair measured within ``max_age_s``; older pairs are forgotten."""
        stale = [key for key, p in self._pairs.items() if now_s - p.measured_s > self.max_age_s]
        for key in stale:
            del self._pairs[key]
        return {key: p.bytes_per_s for key, p in self._pairs.items()}
